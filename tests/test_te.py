"""The Transformer Engine path (``backend: transformer_engine``): runs only where TE imports and a
CUDA GPU is present (never on the project's machines: these tests skip there, and nothing in
the docs claims this path is verified). On such a machine they check that our layers' GEMMs go
through TE with our parameters and give the local path's losses within bf16 / FP8 tolerance."""
from __future__ import annotations

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="Transformer Engine needs a CUDA device")]

from dept_mega.model import build_model, describe_backends  # noqa: E402
from dept_mega.parallel.groups import build_groups  # noqa: E402
from tests.model_utils import full_tensors, rel_err  # noqa: E402
from tests.trainer_utils import tiny_config  # noqa: E402


def _losses_grads(cfg):
    (stage,) = build_model(cfg, build_groups(), 100, 5, "cuda")
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 100, (2, 16), generator=g).cuda()
    labels = torch.randint(0, 100, (2, 16), generator=g).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        losses = stage(tokens, labels)
    losses.mean().backward()
    return stage, losses.detach().float(), full_tensors(stage, build_groups(), grads=True)


@pytest.mark.parametrize("fp8", [None, "hybrid"])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_te_backend_matches_local(fp8, recipe):
    over = {"precision": "bf16", "fp8": fp8, "fp8_recipe": recipe}
    _, ref_losses, ref_grads = _losses_grads(tiny_config({**over, "backend": "local", "fp8": None}))
    cfg = tiny_config({**over, "backend": "transformer_engine"})
    assert "linear=transformer_engine" in describe_backends(cfg, "cuda")
    stage, losses, grads = _losses_grads(cfg)
    assert stage.body.layers["0"].attention.qkv._te.module is not None  # TE ran the GEMM
    assert stage.body.layers["0"].attention.qkv._te.module.weight is stage.body.layers["0"].attention.qkv.weight
    assert rel_err(losses, ref_losses) < (0.02 if fp8 else 0.005)
    for k, g in ref_grads.items():
        assert rel_err(grads[k], g) < (0.2 if fp8 else 0.02), k
