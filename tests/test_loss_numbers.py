"""One number of the loss, one place (issue 46): the loss kernels read the variant's runtime
numbers from one tuple, so that a new one touches five library files (docs/design.md, section
5: config, reference, token_terms, kernels/token_args, kernels/terms) and no kernel signature,
launcher, op schema or driver line. These tests hold the seams that make that true; a kernel
that grows a parameter per number, or a driver that copies numbers one by one, fails them."""

from __future__ import annotations

import inspect

import pytest

from fusedrl import LossConfig, fused_backend, triton_backend
from fusedrl.kernels import sequence_terms, split_rows, terms, token_loss
from fusedrl.kernels.token_args import KERNEL_SCALARS, LossVariant, variant_scalars

LOSS_KERNELS = (
    token_loss._fused_token_loss_kernel,
    split_rows._split_row_loss_kernel,
    sequence_terms._sequence_terms_kernel,
)


@pytest.mark.parametrize("kernel", LOSS_KERNELS, ids=lambda k: k.__name__)
def test_loss_kernels_take_the_numbers_as_one_tuple(kernel):
    params = inspect.signature(kernel.fn).parameters
    assert "loss_scalars" in params
    assert not set(KERNEL_SCALARS) & set(params), "a number of the loss as its own parameter"


def test_each_number_has_its_index_in_the_terms():
    for position, name in enumerate(KERNEL_SCALARS):
        assert name in LossVariant._fields, name
        assert getattr(terms, f"{name.upper()}_AT").value == position, name


def test_the_tuple_follows_the_names_order():
    numbers = {name: float(i + 2) for i, name in enumerate(KERNEL_SCALARS)}
    assert variant_scalars(LossVariant(**numbers)) == tuple(numbers.values())
    # an option that is off (None) reaches the kernels as 0.0, its switch off
    assert variant_scalars(LossVariant(dual_clip_c=None))[KERNEL_SCALARS.index("dual_clip_c")] == 0


def test_the_driver_copies_every_number_from_the_config():
    """Every number but the call's ratio bounds is the config's field of its name (SAPO's
    temperatures: sapo_tau_*): set each to a distinct value and find it in the variant."""
    values = {"dual_clip_c": 3.5, "delta": 2.5, "beta": 0.25, "entropy_coef": 0.125}
    values |= {"sapo_tau_pos": 1.75, "sapo_tau_neg": 1.5}
    cfg = LossConfig.preset("dapo").replace(**values, kl="k3")
    variant = fused_backend._variant_of(cfg, 1.0, None, 0.8, 1.28, False)
    renamed = {"tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg"}  # SAPO's, in the config
    for name in KERNEL_SCALARS:
        if name in ("low_bound", "high_bound"):
            continue
        assert getattr(variant, name) == values[renamed.get(name, name)], name
    assert (variant.low_bound, variant.high_bound) == (0.8, 1.28)


def test_the_terms_op_takes_every_number():
    assert set(KERNEL_SCALARS) <= set(triton_backend.SEQUENCE_FIELDS)
