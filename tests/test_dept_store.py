"""Source moves carry a JSON header and tensors, never pickle: payloads round-trip (optimizer
state included, bit for bit), and a malformed header is one clear error naming the peer."""
import inspect

import pytest
import torch

from dept_mega.dept import store
from dept_mega.dept.store import encode, parse_header, unpack
from tests.mp_utils import run_distributed


def _round_trip(payload):
    raw, tensors = encode(payload)
    header = parse_header(raw, peer=0)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == header.specs
    return unpack(header.tree, [t.clone() for t in tensors])


def test_payload_round_trips_through_json_and_tensors():
    payload = {"embeddings": [None, {"w": torch.randn(3, 2), "i": torch.arange(4)}],
               "extra": {"round": 3, "name": "s1", "ok": True, "lr": 0.1, "nan": float("inf"), "none": None},
               "optimizer": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"betas": (0.9, 0.95)}]},
               "half": torch.ones(2, dtype=torch.bfloat16), "flags": torch.tensor([True, False])}
    got = _round_trip(payload)
    assert got["embeddings"][0] is None and torch.equal(got["embeddings"][1]["w"], payload["embeddings"][1]["w"])
    assert got["extra"] == payload["extra"]
    assert list(got["optimizer"]["state"]) == [0]  # int keys stay int
    assert got["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.95]  # tuples arrive as lists
    assert got["half"].dtype == torch.bfloat16 and got["flags"].dtype == torch.bool
    with pytest.raises(TypeError, match="cannot send a value of type object"):
        encode({"x": object()})
    with pytest.raises(TypeError, match="dict key of type tuple"):
        encode({(1, 2): 3})


def test_optimizer_state_through_json_continues_bit_for_bit():
    """AdamW state sent as JSON + tensors (betas become a list) loads and steps exactly like
    the original."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), foreach=True)
    grads = [[torch.randn_like(p) for p in params] for _ in range(4)]
    for g in grads[:2]:
        for p, x in zip(params, g):
            p.grad = x.clone()
        opt.step()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_opt = torch.optim.AdamW(twins, lr=1e-2, betas=(0.9, 0.95), foreach=True)
    twin_opt.load_state_dict(_round_trip(opt.state_dict()))
    for g in grads[2:]:
        for ps, o in ((params, opt), (twins, twin_opt)):
            for p, x in zip(ps, g):
                p.grad = x.clone()
            o.step()
    for a, b in zip(params, twins):
        assert torch.equal(a, b)


@pytest.mark.parametrize("raw,why", [
    (b"\x80not utf-8", "not UTF-8 JSON"),
    (b"[1, 2]", "expected an object"),
    (b'{"version": 9, "tensors": [], "tree": null}', "version 9"),
    (b'{"version": 1, "tensors": [[[2], "object"]], "tree": {"tensor": 0}}', "tensor 0"),
    (b'{"version": 1, "tensors": [], "tree": {"tensor": 0}}', "tensor index 0"),
    (b'{"version": 1, "tensors": [], "tree": {"pickle": "x"}}', "unknown kind"),
    (b'{"version": 1, "tensors": [], "tree": [1]}', "bare array"),
    (b'{"version": 1, "tensors": [[[1], "float32"]], "tree": null}', "1 tensors announced, 0 referenced"),
])
def test_malformed_header_names_the_peer(raw, why):
    with pytest.raises(ValueError, match=f"malformed header from rank 5: .*{why}"):
        parse_header(raw, peer=5)


def test_store_never_unpickles():
    src = inspect.getsource(store)
    assert "import pickle" not in src and "pickle.loads" not in src


def _garbage_worker(rank, world):
    from dept_mega.dept.store import Transfer, exchange
    from dept_mega.parallel.groups import build_groups
    pg = build_groups(1, 1, 1)
    if rank == 0:  # a peer speaking something else: a length, then bytes that are no header
        junk = torch.frombuffer(bytearray(b"\x80\x03cos\nsystem\n"), dtype=torch.uint8)
        pg.comm.send(torch.tensor([junk.numel()], dtype=torch.int64), 1, category="source_move")
        pg.comm.send(junk, 1, category="source_move")
        return None
    try:
        exchange(pg, [Transfer(0, False)], torch.device("cpu"))
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
def test_exchange_refuses_a_malformed_header_from_a_peer():
    res = run_distributed(_garbage_worker, 2)
    assert res[1].startswith("source move: malformed header from rank 0: not UTF-8 JSON"), res[1]
