"""A static check of the SASS (``nvdisasm`` output) of a Triton kernel compiled for a GPU we
may not have: in every loop, each byte stored to shared memory by ``STS.U8`` (how Triton moves
an FP8 tile to the transposed layout) must have been computed in the same iteration, not taken
from a register that the loop body reads before it writes it (the previous iteration's value,
uninitialised in the first).

Why: Triton 3.6's bundled ptxas (CUDA 12.8) miscompiled the LayerNorm FP8 cast with both layouts:
the packed FP8 conversions shared by the row-major and the transposed stores were split into
bytes by a ``PRMT`` into a register that an earlier instruction already read, so one transposed
byte in four was stale (seen on an H200; see ``fp8_triton._store_fp8``). A GPU run finds it only
where the stale byte differs from the right one; this check finds it in the compiled code.

The analysis is symbolic over the bytes of the registers of one loop body, in program order:
``F2FP`` (packed FP8 conversion; the converted pair in the low half, ``C``'s low half in the
high one), ``PRMT`` (byte permute), ``LOP3`` (an AND with a byte mask), ``SHF.R.U32.HI`` by whole
bytes and moves are followed byte by byte; any other instruction makes new bytes. A byte read
from a register not yet written in the body is an input of the body ("in").
"""
from __future__ import annotations

import re

_ZERO = ("zero",)
_INSTR = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")


def _parse(sass: str) -> list:
    out = []
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            args = [a.strip() for a in m.group(4).split(",")] if m.group(4) else []
            out.append((int(m.group(1), 16), m.group(3), args, line.strip()))
    return out


def _loops(sass: str, instrs: list) -> list:
    """The bodies (instruction lists) of the loops: a branch back to an earlier label."""
    lines = sass.splitlines()
    labels = {}
    for j, line in enumerate(lines):
        m = re.match(r"(\.L_x_\d+):", line)
        if m:
            nxt = next((_INSTR.match(x) for x in lines[j + 1:] if _INSTR.match(x)), None)
            if nxt:
                labels[m.group(1)] = int(nxt.group(1), 16)
    bodies = []
    for pc, op, args, _ in instrs:
        if op.startswith("BRA") and args:
            target = labels.get(args[0].strip("`() "))
            if target is not None and target < pc:
                bodies.append([i for i in instrs if target <= i[0] <= pc])
    return bodies


def _bytes(regs: dict, tok: str):
    tok = tok.replace(".reuse", "").strip()
    if tok == "RZ":
        return [_ZERO] * 4
    m = re.fullmatch(r"R(\d+)", tok)
    if not m:
        return None
    r = int(m.group(1))
    if r not in regs:
        regs[r] = [("in", r, i) for i in range(4)]
    return regs[r]


def _body_problems(body: list) -> list:
    regs, problems = {}, []
    for pc, op, args, text in body:
        base = op.split(".")[0]
        if base == "STS" and "U8" in op.split("."):
            b = _bytes(regs, args[-1])
            if b is None or b[0][0] == "in":
                problems.append(f"{text}: stores byte {None if b is None else b[0]}, not computed in this iteration")
            continue
        if base in ("STS", "STG", "STL", "ST", "BAR", "BRA", "EXIT", "RED", "ATOM", "ATOMG") or "SETP" in base:
            continue
        i = 0
        while i < len(args) and re.fullmatch(r"!?U?P(\d+|T)", args[i]):  # predicate destinations (SHFL PT, R..)
            i += 1
        if i >= len(args) or not re.fullmatch(r"R\d+", args[i]):
            continue
        dst, srcs = int(args[i][1:]), args[i + 1:]
        for s in srcs:  # every register read before the write (a read-before-write makes an input)
            for r in re.findall(r"(?<![A-Z0-9_])R(\d+)", s):
                _bytes(regs, f"R{r}")
        out = None
        if base == "F2FP" and "MERGE_C" in op and len(srcs) == 3:
            c = _bytes(regs, srcs[2]) or [("op", pc, 2), ("op", pc, 3)]
            out = [("cvt", pc, 0), ("cvt", pc, 1), c[0], c[1]]
        elif base == "PRMT" and len(srcs) == 3 and re.fullmatch(r"0x[0-9a-f]+", srcs[1]):
            a, b = _bytes(regs, srcs[0]), _bytes(regs, srcs[2])
            if a and b:
                sel = int(srcs[1], 16)
                out = [(a + b)[(sel >> (4 * j)) & 7] for j in range(4)]
        elif base == "LOP3" and len(srcs) >= 4 and srcs[2] == "RZ" and srcs[3].startswith("0xc0") \
                and re.fullmatch(r"0x[0-9a-f]+", srcs[1]):
            a, mask = _bytes(regs, srcs[0]), int(srcs[1], 16)
            if a and all(((mask >> (8 * j)) & 0xFF) in (0, 0xFF) for j in range(4)):
                out = [a[j] if (mask >> (8 * j)) & 0xFF else _ZERO for j in range(4)]
        elif op == "SHF.R.U32.HI" and len(srcs) == 3 and srcs[0] == "RZ" and re.fullmatch(r"0x[0-9a-f]+|\d+", srcs[1]) \
                and int(srcs[1], 0) % 8 == 0:
            a, k = _bytes(regs, srcs[2]), int(srcs[1], 0) // 8
            if a:
                out = [(a + [_ZERO] * 4)[j + k] for j in range(4)]
        elif (base == "MOV" and len(srcs) == 1) or (op == "IMAD.MOV.U32" and srcs[:2] == ["RZ", "RZ"]):
            a = _bytes(regs, srcs[-1])
            if a:
                out = list(a)
        regs[dst] = out or [("op", pc, j) for j in range(4)]
    return problems


def stale_shared_bytes(sass: str) -> list:
    """Descriptions of the ``STS.U8`` in a loop that store a byte the iteration did not compute."""
    instrs = _parse(sass)
    return [p for body in _loops(sass, instrs) for p in _body_problems(body)]


def count_byte_stores(sass: str) -> int:
    """How many ``STS.U8`` the listing has (a check that the layout the analysis covers is there)."""
    return sum(1 for _, op, _, _ in _parse(sass) if op.split(".")[0] == "STS" and "U8" in op.split("."))
