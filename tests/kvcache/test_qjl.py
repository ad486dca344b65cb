"""QJL keys (arXiv 2406.03482): the calibrated key mean is exact on scores and cuts the estimator's error."""

from __future__ import annotations

import torch

from bytediet.calibrate.kv import calibrate_from_samples, has_calibration
from bytediet.kvcache import get_kv_codec
from tests.kvcache.test_turboquant import _attention_error


def test_calibrated_mean_is_exact_and_cuts_error_on_offset_keys():
    g = torch.Generator().manual_seed(5)
    offset = 6 * torch.randn(1, 2, 64, generator=g)
    k, v = torch.randn(128, 2, 64, generator=g) + offset, torch.randn(128, 2, 64, generator=g)
    q = torch.randn(128, 4, 64, generator=g)
    plain = _attention_error(get_kv_codec("qjl4"), k, v, q)  # also checks attend == attention over decode
    codec = get_kv_codec("qjl4")
    assert has_calibration(codec)
    kc = torch.randn(512, 2, 64, generator=g) + offset
    calibrate_from_samples(codec, [{"k": kc, "v": torch.randn(512, 2, 64, generator=g), "q": None}])
    assert torch.allclose(codec.key_half.means[0], offset[0], atol=0.2)
    centred = _attention_error(codec, k, v, q)
    assert centred < 0.6 * plain, (centred, plain)
