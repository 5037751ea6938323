"""Per-layer weight facts the cost model reads: bytes and files per home tier, matmul elements, compressed
elements, and those in the int4 kernel's order."""
from __future__ import annotations

from typing import Optional

import torch

from flexh2o.compress import CompressionSpec, stored_parts, weight_spec
from flexh2o.placement import WeightHomes
from flexh2o.run_config import RunConfig
from flexh2o.units import padded
from flexh2o.weights.forms import in_kernel_order, is_lookup, kernel_layout


def weight_layout(homes: WeightHomes, dtype: torch.dtype, compress: Optional[CompressionSpec] = None,
                  layout: bool = False) -> tuple:
    """Per layer: ((tier, bytes, bytes padded for disk files, number of files) per home tier, elements of the
    matrices used in matmuls, elements stored compressed, and of those in the int4 kernel's order (layout:
    weights/forms.py) (elements of matmul weights, ((elements, width) of lookup tables))). Depends only on the
    weights' homes, the storage dtype and --compress-weight (compressed tensors are two files, data and meta)."""
    weights, params2d, packed, kernel = [], [], [], []
    for i, layer in enumerate(homes.layer_specs):
        ordered = [s for s in layer if in_kernel_order(s, compress, layout)]
        kernel.append((sum(s.numel for s in ordered if not is_lookup(i, s)),
                       tuple((s.numel, s.shape[1]) for s in ordered if is_lookup(i, s))))
        per_tier: dict = {}
        for s in layer:
            parts = stored_parts(s.shape, dtype, weight_spec(s.shape, compress, s.name))
            got = per_tier.get(homes[s.name], (0, 0, 0))
            per_tier[homes[s.name]] = (got[0] + sum(parts), got[1] + sum(map(padded, parts)), got[2] + len(parts))
        weights.append(tuple(sorted((t, *v) for t, v in per_tier.items())))
        params2d.append(sum(s.numel for s in layer if len(s.shape) == 2 and not is_lookup(i, s)))
        packed.append(sum(s.numel for s in layer if weight_spec(s.shape, compress, s.name)))
    return tuple(weights), tuple(params2d), tuple(packed), tuple(kernel)


def layout_of(rc: RunConfig, memo: Optional[dict]) -> tuple:
    """weight_layout of rc's weights (kept in `memo` when given: a search evaluates many RunConfigs)."""
    key = ("layout", rc.percent.shares("weights"), rc.dtype, rc.compress_weight, kernel_layout(rc))
    if memo is None or key not in memo:
        got = weight_layout(rc.placement.weights, rc.dtype, rc.compress_weight, kernel_layout(rc))
        if memo is None:
            return got
        memo[key] = got
    return memo[key]
