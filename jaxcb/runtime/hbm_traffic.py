"""HBM bytes a compiled TPU or GPU program moves, read off its optimized HLO.

XLA's TPU `cost_analysis()` "bytes accessed" counts every memory an instruction touches,
VMEM included: a lone [256, 4096] x [4096, 12288] bf16 matmul reports 512 MB where the
weight (101 MB), the input and the output (8 MB) are all HBM must give, because the weight
is copied into VMEM first (`copy-start`, counted as read and write, tuple and all) and the
dot is counted again reading that copy. Set against HBM bandwidth, that is not a roofline.

`hbm_bytes` walks the optimized module instead and counts, per instruction run, the bytes
of its operands and results that live in HBM (no memory-space annotation `S(n)` in the
layout; S(1) is VMEM, S(2) SMEM), with what a TPU program does in place or in part:

- a fusion reads of an operand only what its fused computation slices or gathers from it,
  nested fusions included (an embedding lookup reads its rows, not the table; a scanned
  layer's matmul its layer of the stacked weight);
- a fusion whose root scatters or dynamic-update-slices into one of its operands (the
  donated KV pool) writes the update in place: the update's bytes, not the operand's;
- an async copy or slice into VMEM (`copy-start`, `slice-start`) reads its HBM source
  once; `*-done`, bitcasts, tuples and parameters move nothing;
- Pallas kernels (Mosaic's `tpu_custom_call`, Triton calls on GPU) count 0 here: the
  caller adds the `pl.CostEstimate` they declare;
- a while loop's body and condition count once per trip where the trip count shows (a scan
  over the layers: XLA's `known_trip_count`, or its condition `i < N`), else once; a
  conditional its heaviest branch;
- a lone slice or dynamic slice (a layer's weights sliced out of their stack and copied)
  reads and writes the slice, not the whole stack.

It is a model of traffic, not a measurement: fusions that re-read an HBM operand (a
matmul whose weight does not fit VMEM, tiled over both sides) count it once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%([\w.\-]+))"
)
# Instructions that move no bytes of their own (async `*-done` halves: their `*-start` counts).
_FREE = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-done",
    "slice-done", "all-gather-done", "all-reduce-done", "collective-permute-done",
    "async-done", "send-done", "recv-done", "domain",
}  # fmt: skip
_SLICING = {"dynamic-slice", "slice", "gather"}
#: Pallas kernels' custom calls (Mosaic on TPU, Triton on GPU): counted by the caller.
KERNEL_CALLS = ('custom_call_target="tpu_custom_call"', 'custom_call_target="__gpu$xla.gpu.triton"')
_IN_PLACE = {"scatter", "dynamic-update-slice"}
_TRIP_COUNT = re.compile(r"known_trip_count\W+n\W+(\d+)")
_CONDITION = re.compile(r"condition=%([\w.\-]+)")
_INT_CONSTANT = re.compile(r"^s32\[\]\S*$")


def trip_count(inst: Instruction, computations: dict[str, list[Instruction]]) -> int:
    """How many times a while loop runs its body: XLA's known_trip_count where it writes one
    (GPU), else a scan's condition `counter < N` read off the condition computation (TPU;
    jax's scans count from 0), else 1."""
    if found := _TRIP_COUNT.search(inst.attrs):
        return int(found.group(1))
    condition = _CONDITION.search(inst.attrs)
    body = computations.get(condition.group(1), []) if condition else []
    root = body[-1] if body else None
    if root is None or root.op != "compare" or "direction=LT" not in root.attrs:
        return 1
    constants = {
        i.name: i.args for i in body if i.op == "constant" and _INT_CONSTANT.match(i.shape)
    }
    bound = constants.get(root.operands[-1]) if len(root.operands) == 2 else None
    return int(bound) if bound is not None and bound.isdigit() else 1


@dataclass
class Instruction:
    name: str
    shape: str  # the result's shape text, a tuple's in parentheses
    op: str
    operands: list[str]
    attrs: str
    args: str  # the text in the parentheses (a parameter's number)
    users: list[Instruction] = field(default_factory=list)


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 8 if dtype.endswith("64") else 4)


def shape_bytes(shape: str, *, hbm_only: bool = True) -> int:
    """Bytes of the arrays in a shape's text (a tuple's summed); with `hbm_only`, only
    those without a memory-space annotation other than S(0)."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(shape):
        space = _MEMORY_SPACE.search(layout or "")
        if hbm_only and space and space.group(1) != "0":
            continue
        total += _itemsize(dtype) * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _split_top(text: str) -> tuple[str, str]:
    """(the balanced-parenthesis group text starts with, the rest)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return text[: i + 1], text[i + 1 :]
    raise ValueError(f"unbalanced parentheses in {text[:80]!r}")


def _parse_instruction(line: str) -> Instruction | None:
    body = line.strip().removeprefix("ROOT ")
    if not body.startswith("%") or " = " not in body:
        return None
    name, rest = body[1:].split(" = ", 1)
    if rest.startswith("("):
        shape, rest = _split_top(rest)
    else:
        shape, _, rest = rest.partition(" ")
    rest = rest.strip()
    op, paren, rest = rest.partition("(")
    if not paren:
        return None
    args, attrs = _split_top("(" + rest)
    operands = re.findall(r"%([\w.\-]+)", args)
    return Instruction(name, shape, op.strip(), operands, attrs, args[1:-1])


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """The computations of an HLO module's text (name -> instructions in order), and the
    entry computation's name."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.split()
            is_entry = head[0] == "ENTRY"
            current = (head[1] if is_entry else head[0]).lstrip("%")
            entry = current if is_entry else entry
            computations[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None and (inst := _parse_instruction(line)):
            computations[current].append(inst)
    for instructions in computations.values():
        by_name = {i.name: i for i in instructions}
        for inst in instructions:
            for operand in inst.operands:
                if operand in by_name:
                    by_name[operand].users.append(inst)
    if not entry:
        raise ValueError("no ENTRY computation in the module text")
    return computations, entry


class _Walker:
    def __init__(self, computations: dict[str, list[Instruction]], branch: str = "max"):
        self.computations = computations
        self.pick = {"max": max, "min": min}[branch]
        self.shapes = {i.name: i.shape for insts in computations.values() for i in insts}
        self.roots = {insts[-1].name for insts in computations.values() if insts}
        self.memo: dict[str, int] = {}

    def computation(self, name: str) -> int:
        if name not in self.memo:
            self.memo[name] = 0  # recursion guard
            self.memo[name] = sum(self.instruction(i) for i in self.computations.get(name, ()))
        return self.memo[name]

    def operand_bytes(self, name: str) -> int:
        return shape_bytes(self.shapes.get(name, ""))

    def instruction(self, inst: Instruction) -> int:
        op = inst.op
        if op in _FREE:
            return 0
        if op == "while":
            trips = trip_count(inst, self.computations)
            return trips * sum(self.computation(c) for c in _CALLS.findall(inst.attrs))
        if op == "conditional":
            names = [n for group, one in _BRANCHES.findall(inst.attrs) for n in (group, one) if n]
            branches = [b.strip().lstrip("%") for n in names for b in n.split(",")]
            return self.pick((self.computation(b) for b in branches), default=0)
        if op == "call":
            return sum(self.computation(c) for c in _CALLS.findall(inst.attrs))
        if op == "custom-call" and any(k in inst.attrs for k in KERNEL_CALLS):
            return 0
        if op in ("copy-start", "slice-start"):
            return self.async_copy(inst)
        if op == "fusion":
            return self.fusion(inst)
        if op in _IN_PLACE:
            update = self.operand_bytes(inst.operands[-1])
            return 2 * update + sum(self.operand_bytes(o) for o in inst.operands[1:-1])
        if op in ("slice", "dynamic-slice"):  # (the offsets are scalars)
            return 2 * shape_bytes(inst.shape)
        return shape_bytes(inst.shape) + sum(self.operand_bytes(o) for o in inst.operands)

    def async_copy(self, inst: Instruction) -> int:
        """copy-start / slice-start: ((dest...), dest, context) tuples; the source is read for
        what lands in the destination, the destination written if it is in HBM."""
        parts = _ARRAY.findall(inst.shape)
        if not parts or not inst.operands:
            return 0
        dtype, dims, layout = parts[-2] if inst.op == "slice-start" else parts[0]
        text = f"{dtype}[{dims}]{layout}"
        moved = shape_bytes(text, hbm_only=False)
        source_in_hbm = self.operand_bytes(inst.operands[0]) > 0
        return moved * source_in_hbm + shape_bytes(text)

    def called_body(self, fusion: Instruction) -> list[Instruction]:
        """The instructions of the computation a fusion calls."""
        called = _CALLS.findall(fusion.attrs)
        return self.computations.get(called[0], []) if called else []

    def fusion(self, inst: Instruction) -> int:
        body = self.called_body(inst)
        params = {int(i.args): i for i in body if i.op == "parameter" and i.args.isdigit()}
        root = body[-1] if body else None
        written = shape_bytes(inst.shape)
        in_place = None
        if root is not None and root.op in _IN_PLACE:
            target = next((i for i in body if i.name == root.operands[0]), None)
            if target is not None and target.op == "parameter":
                in_place = target.name
                written = 2 * self.operand_bytes_in(body, root.operands[-1])
        total = written
        for index, operand in enumerate(inst.operands):
            full = self.operand_bytes(operand)
            param = params.get(index)
            if param is None or full == 0:
                total += full
            elif param.name == in_place:
                continue  # written in place: counted as the update above
            else:
                total += min(full, self.read_bytes(param, full))
        return total

    def operand_bytes_in(self, body: list[Instruction], name: str) -> int:
        inst = next((i for i in body if i.name == name), None)
        return shape_bytes(inst.shape, hbm_only=False) if inst else 0

    def read_bytes(self, inst: Instruction, full: int) -> int:
        """What the users of a fused value read of it: the slices where every use slices it
        (through bitcasts and nested fusions), else all of it."""
        total = 0
        for user in inst.users:
            if user.op in _SLICING and user.operands and user.operands[0] == inst.name:
                total += shape_bytes(user.shape, hbm_only=False)
            elif user.op == "bitcast" or (user.op == "fusion" and self.relayout(user)):
                total += self.read_bytes(user, full)
            elif user.op == "fusion":  # (a dynamic slice fused into a dot: a scan's layer)
                total += sum(self.read_bytes(param, full) for param in self.params_fed(user, inst))
            else:
                return full
        if not inst.users:  # unused, or (through bitcasts) a nested fusion's result: all of it
            return full if inst.name in self.roots else 0
        return total

    def relayout(self, fusion: Instruction) -> bool:
        """Whether a nested fusion only copies its one operand into another layout (a
        stacked int8 weight retiled on TPU before its layer is sliced out): the elements
        its users read are what it reads."""
        ops = [i.op for i in self.called_body(fusion)]
        return len(fusion.operands) == 1 and ops in (
            ["parameter", "copy"],
            ["parameter", "bitcast"],
        )

    def params_fed(self, fusion: Instruction, value: Instruction) -> list[Instruction]:
        """The parameters of nested `fusion`'s computation that `value` is passed as."""
        body = self.called_body(fusion)
        params = {int(i.args): i for i in body if i.op == "parameter" and i.args.isdigit()}
        fed = [i for i, operand in enumerate(fusion.operands) if operand == value.name]
        return [params[i] for i in fed if i in params]


class _KernelCalls(_Walker):
    """Pallas kernel calls one run makes (a conditional's most), loops by their trips."""

    def instruction(self, inst: Instruction) -> int:
        if inst.op in ("while", "conditional", "call"):
            return super().instruction(inst)
        return int(inst.op == "custom-call" and any(k in inst.attrs for k in KERNEL_CALLS))


def kernel_calls(hlo_text: str) -> int:
    """How many Pallas kernel calls one run of the optimized module makes: each call site
    times the trip count of the loops around it (a scan over the layers calls its attention
    kernel once per layer)."""
    computations, entry = parse_module(hlo_text)
    return _KernelCalls(computations).computation(entry)


def hbm_bytes(hlo_text: str, *, branch: str = "max") -> int:
    """HBM bytes one run of the optimized module `hlo_text` moves (see the module doc), each
    conditional by its heaviest (`branch="max"`) or its lightest ("min") branch."""
    computations, entry = parse_module(hlo_text)
    return _Walker(computations, branch).computation(entry)
