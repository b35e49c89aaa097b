"""Offline inference: requests known up front, fed to an engine and collected.

driver.py     the one loop that feeds an engine in a planned order and steps it
ordering.py   submission orders (arrival, shared prefixes together, decode-heavy first)
batch.py      resumable batch inference over a JSONL file (scripts/batch_infer.py);
              batch_input.py (lines read, parsed, tokenized), batch_output.py (results
              appended crash-safe, resuming)
ray_batch.py  the same batch run over engines in Ray actors

`LLM.generate` (jaxcb/llm.py) and perplexity (jaxcb/eval/perplexity.py) drive the engine
through driver.py too.
"""
