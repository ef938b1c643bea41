"""Static memory model: bytes per parameter for each optimizer/precision and ZeRO sharding."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import PlanError
from autopar.pricing.memory import (OPTIMIZERS, PRECISIONS, bytes_per_element, check_optimizer, check_precision,
                            state_bytes, zero_shard)

# (params, grads, optimizer) bytes per element, written out by hand from the module docstring
EXPECTED = {
    ("adamw", "bf16"): (2, 2, 12), ("adam", "bf16"): (2, 2, 12), ("sgd", "bf16"): (2, 2, 8),
    ("lamb", "bf16"): (2, 2, 12), ("lars", "bf16"): (2, 2, 8),
    ("adamw", "fp32"): (4, 4, 8), ("adam", "fp32"): (4, 4, 8), ("sgd", "fp32"): (4, 4, 4),
    ("lamb", "fp32"): (4, 4, 8), ("lars", "fp32"): (4, 4, 4),
}


def test_zero_paper_16_bytes_per_param():
    b = state_bytes(1_000_000, "adamw", "bf16")
    assert b == {"params": 2e6, "grads": 2e6, "optimizer": 12e6}
    assert sum(b.values()) / 1_000_000 == 16


@pytest.mark.parametrize("opt,prec", sorted(EXPECTED))
def test_bytes_per_param(opt, prec):
    p, g, o = EXPECTED[(opt, prec)]
    assert bytes_per_element(opt, prec) == {"params": p, "grads": g, "optimizer": o}
    assert state_bytes(10, opt, prec) == {"params": 10.0 * p, "grads": 10.0 * g, "optimizer": 10.0 * o}


def test_tables_cover_everything():
    assert set(EXPECTED) == {(o, p) for o in OPTIMIZERS for p in PRECISIONS}
    assert OPTIMIZERS == ("adamw", "adam", "sgd", "lamb", "lars") and PRECISIONS == ("bf16", "fp32")


def test_zero_stages_on_bf16_adamw():
    b = state_bytes(1.0, "adamw", "bf16")
    dp = 8
    assert zero_shard(b, 0, dp) == b
    assert zero_shard(b, 1, dp) == {"params": 2, "grads": 2, "optimizer": 12 / 8}
    assert zero_shard(b, 2, dp) == {"params": 2, "grads": 2 / 8, "optimizer": 12 / 8}
    assert zero_shard(b, 3, dp) == {"params": 2 / 8, "grads": 2 / 8, "optimizer": 12 / 8}
    # ZeRO paper, Ψ = 7.5B, N_d = 64: 120 GB -> 31.4 GB (P_os) -> 16.6 GB (P_os+g) -> 1.9 GB (P_os+g+p)
    psi = 7.5e9
    totals = [sum(zero_shard(state_bytes(psi, "adamw", "bf16"), z, 64).values()) / 1e9 for z in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)
    assert b == {"params": 2, "grads": 2, "optimizer": 12}   # input untouched


@settings(deadline=None, max_examples=60)
@given(numel=st.floats(0, 1e12), opt=st.sampled_from(OPTIMIZERS), prec=st.sampled_from(PRECISIONS),
       dp=st.integers(1, 1024), extra=st.floats(0, 1e9))
def test_zero_properties(numel, opt, prec, dp, extra):
    b = {**state_bytes(numel, opt, prec), "activations": extra}
    totals = [sum(zero_shard(b, z, dp).values()) for z in range(4)]
    # each stage shards more, never less; other keys pass through
    assert all(a >= c - 1e-6 * max(1.0, a) for a, c in zip(totals, totals[1:]))
    assert all(zero_shard(b, z, dp)["activations"] == extra for z in range(4))
    z3 = zero_shard(b, 3, dp)
    for k in ("params", "grads", "optimizer"):
        assert z3[k] == pytest.approx(b[k] / dp)
    if dp == 1:
        assert z3 == b


def test_checks_list_valid_values():
    assert check_optimizer("lamb") == "lamb" and check_precision("fp32") == "fp32"
    with pytest.raises(PlanError) as e:
        check_optimizer("adamw8bit")
    assert all(o in str(e.value) for o in OPTIMIZERS)
    with pytest.raises(PlanError, match="did you mean 'adamw'"):
        check_optimizer("admw")
    with pytest.raises(PlanError) as e:
        check_precision("fp16")
    assert "bf16" in str(e.value) and "fp32" in str(e.value)
    with pytest.raises(PlanError):
        check_precision(None)


def test_bad_input():
    with pytest.raises(PlanError, match="ZeRO stage 4"):
        zero_shard(state_bytes(1, "sgd", "fp32"), 4, 2)
    with pytest.raises(PlanError, match="dp"):
        zero_shard(state_bytes(1, "sgd", "fp32"), 1, 0)
    with pytest.raises(PlanError, match="optimizer"):
        zero_shard({"params": 1.0}, 1, 2)
    with pytest.raises(PlanError, match="numel"):
        state_bytes(-1, "sgd", "fp32")
    with pytest.raises(PlanError, match="optimizer"):
        state_bytes(1, "rmsprop", "fp32")
