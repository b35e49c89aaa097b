"""Where XLA's own cost counts of a compiled step are off, read off its HLO text, and by how
much: the flops of a loop body it counts once where the loop runs it once per trip (a scan
over the layers), and the bytes of an in-place scatter it counts as a whole-operand read
and write (the KV write into the donated pool). aot_report.py applies both.
"""

from __future__ import annotations

import math
import re

import jax

from jaxcb.runtime import hbm_traffic


def loop_flops_undercount(hlo_text: str) -> float:
    """Flops XLA's cost analysis leaves out of a compiled module with loops of known trip
    count: it counts a while body once, where a scan over the layers runs it once per layer
    (Qwen3-8B on v5e x4 at (64, 16), scanned: 33 GFLOP by cost_analysis, 6.2 a layer).
    Each such loop's body is cut out as a module of its own and costed by XLA's HLO cost
    analysis through the CPU client; it adds (trips - 1) x that, and the loops nested in it
    (their trips times theirs)."""
    from jaxlib import _hlo, _jax

    computations, entry = hbm_traffic.parse_module(hlo_text)
    blocks = _computation_texts(hlo_text)
    cpu = jax.devices("cpu")[0].client

    def flops_of(root: str) -> float:
        parts = ["HloModule loop_body", ""]
        for name, text in blocks.items():
            if name != entry:
                parts += [("ENTRY " if name == root else "") + text, ""]
        module = _hlo.hlo_module_from_text("\n".join(parts))
        return float(_jax.hlo_module_cost_analysis(cpu, module).get("flops", 0.0))

    def undercount(name: str) -> float:
        total = 0.0
        for inst in computations.get(name, ()):
            body = _LOOP_BODY.search(inst.attrs) if inst.op == "while" else None
            trips = hbm_traffic.trip_count(inst, computations) if body else 1
            if body and trips > 1:
                inner = undercount(body.group(1))
                total += (trips - 1) * flops_of(body.group(1)) + trips * inner
        return total

    return undercount(entry)


_LOOP_BODY = re.compile(r"body=%([\w.\-]+)")
_METADATA = re.compile(r", metadata=\{[^}]*\}")


def _computation_texts(hlo_text: str) -> dict[str, str]:
    """Each computation's text in a module's (name -> its lines, without ENTRY and without
    metadata, whose stack frame ids refer to the whole module's table)."""
    blocks: dict[str, str] = {}
    name, lines = None, []
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.removeprefix("ENTRY ")
            name, lines = head.split()[0].lstrip("%"), [head]
        elif name is not None:
            lines.append(_METADATA.sub("", line))
            if line.startswith("}"):
                blocks[name], name = "\n".join(lines), None
    return blocks


_SHAPE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]")
_SCATTER = re.compile(r"= (\w+)\[([\d,]*)\]\S* scatter\(%[^,]+, %[^,]+, %([^,)]+)\)")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def _array_bytes(dtype: str, dims: str) -> int:
    itemsize = _ITEMSIZE.get(dtype, 8 if dtype.endswith("64") else 4)
    return itemsize * math.prod(int(d) for d in dims.split(",") if d)


def inplace_scatter_overcount(hlo_text: str, operand_bytes: int) -> int:
    """Bytes XLA's HLO cost analysis counts too many for the scatters into an operand of
    `operand_bytes` (the donated KV pool's arrays), done in place: it counts the operand
    read and the result written whole (2 x operand), where the in-place write touches only
    the update rows (their bytes; reading them as the scatter's input is counted already)."""
    lines = hlo_text.splitlines()
    shapes = {m[1]: _array_bytes(m[2], m[3]) for m in map(_SHAPE.match, lines) if m}
    over = 0
    for dtype, dims, updates in _SCATTER.findall(hlo_text):
        if _array_bytes(dtype, dims) == operand_bytes:
            over += 2 * operand_bytes - shapes.get(updates, 0)
    return over
