"""Step prices for ``speculative="auto"``: a cost model fitted across every calibrated option, pooled with each
option's own measurements.

The calibration (:class:`~lightning_mtp.decoding.calibration.RoundRobin`) gives, per drafting option, a few paired
ratios of its step time to a steady plain step. Taken alone, an option's median of two ratios is noisy (on this
project's 2-core machine single ratios spread by 20-30%), and the policy then takes the option whose noise came out
cheapest: the winner's curse (measured on the ``transformers`` host: in one run the tree ``[4, 1]`` took 940 of 980
steps and ``auto`` decoded at 0.86x of plain; three other calibrations priced that tree at 2.59-2.65 plain steps and the
chain of 2, which accepts within 4% as much, at 2.20-2.35). But the options share their parts: a step with option X
costs one verify forward over its N + 1 tokens, one call per drafted depth, the extra tokens those calls run for the
tree's nodes, and (trees only) the tree verification's mask and cache moves. So every ratio is also a sample of

    ratio(X) - 1 = a + b·N + c·depths + d·(module tree tokens) + e·[X is a tree]

fitted through the options' median ratios by a median regression (least absolute deviations: a burst on a shared machine
or one lucky option moves it little). Each option's price is then its own median and the fit's prediction averaged, the
fit counting as ``POOL_WEIGHT`` samples (partial pooling, "empirical Bayes"): an option timed twice is priced mostly by
the fit, a contender timed ten times mostly by its own steps, and the model's misfit (a verify's cost is not exactly
linear in its tokens) fades where the measurements are many.

Example::

    >>> from lightning_mtp.decoding.tree import TreeShape
    >>> shapes = [TreeShape.chain(k) for k in (1, 2, 3, 4)] + [TreeShape(branching=b) for b in
    ...           [(2,), (4,), (2, 1), (4, 1), (2, 2), (4, 2), (2, 1, 1)]]
    >>> cost = lambda s: 1.2 + 0.05 * s.num_nodes + 0.5 * s.depth + 0.3 * (not s.is_chain)
    >>> ratios = {s.describe(): [cost(s) * f for f in (0.97, 1.0, 1.03)] for s in shapes}
    >>> ratios["chain2"] = [1.5, 1.6]  # a lucky draw
    >>> prices = pooled_ratios(ratios, {s.describe(): s for s in shapes})
    >>> round(prices["chain3"], 2), round(cost(TreeShape.chain(3)), 2)
    (2.85, 2.85)
    >>> round(prices["chain2"], 2), cost(TreeShape.chain(2))  # 4 parts the fit, 2 parts its own median 1.55
    (2.05, 2.3)
"""

from __future__ import annotations

import statistics
from typing import Optional

import torch
from torch import Tensor

from lightning_mtp.decoding.tree import TreeShape

POOL_WEIGHT = 4.0
"""The fitted cost counts as this many samples of an option's own ratio."""
MIN_POOLED_OPTIONS = 8
"""Fewer calibrated options than this: each keeps its own median (too few to fit the model's five terms)."""
LAD_ITERATIONS = 30
"""Reweighting rounds of the median regression."""
RESIDUAL_FLOOR = 1e-3
"""Residuals below this fraction of the typical ratio weigh as much as it (keeps the reweighting finite)."""


def step_features(shape: TreeShape) -> list[float]:
    """The cost model's terms of a drafting step with ``shape``: [1, N, depths, module tree tokens, is a tree].

    Module k runs its linear window plus the tree's nodes of depths < k (a chain's k - 1 drafts; a dynamic tree's
    expanded frontier, ``top_k`` nodes per depth)."""
    if shape.dynamic:
        per_depth = [shape.top_k] * shape.depth  # the nodes expanded at each depth
    else:
        per_depth, width = [], 1
        for branch in shape.branching:
            width *= branch
            per_depth.append(width)
    tree_tokens = sum(sum(per_depth[: k - 1]) for k in range(2, shape.depth + 1))
    return [1.0, float(shape.num_nodes), float(shape.depth), float(tree_tokens), 0.0 if shape.is_chain else 1.0]


def fit_step_costs(ratios: dict[str, list[float]], shapes: dict[str, TreeShape]) -> Optional[Tensor]:
    """Least-absolute-deviation coefficients of :func:`step_features` for ``ratio - 1``, one point per option (its
    median ratio: the options weigh alike, however often each was timed), by iteratively reweighted least squares;
    a median regression, so that a few options far off the model (a burst on a shared machine, a lucky draw) move it
    little. ``None`` with fewer than ``MIN_POOLED_OPTIONS`` options."""
    keys = [key for key, values in ratios.items() if values and key in shapes]
    if len(keys) < MIN_POOLED_OPTIONS:
        return None
    features = torch.tensor([step_features(shapes[key]) for key in keys], dtype=torch.float64)  # (O, 5)
    targets = torch.tensor([statistics.median(ratios[key]) - 1.0 for key in keys], dtype=torch.float64)  # (O,)
    floor = RESIDUAL_FLOOR * float(targets.abs().median().clamp_min(1e-9))
    weights = torch.ones_like(targets)
    for _ in range(LAD_ITERATIONS):
        root = weights.sqrt().unsqueeze(1)
        coefficients = _least_squares(features * root, targets * root.squeeze(1))
        weights = 1.0 / (targets - features @ coefficients).abs().clamp_min(floor)
    return coefficients


def _least_squares(features: Tensor, targets: Tensor) -> Tensor:
    """argmin_c |features @ c - targets|² (minimum norm where the terms are collinear, e.g. chains only)."""
    return torch.linalg.lstsq(features, targets.unsqueeze(1), driver="gelsd").solution.squeeze(1)


def pooled_ratios(ratios: dict[str, list[float]], shapes: dict[str, TreeShape]) -> dict[str, float]:
    """Per option with samples: its price in steady plain steps, (n · own median + ``POOL_WEIGHT`` · fitted) /
    (n + ``POOL_WEIGHT``), n = its samples; each own median alone when the model cannot be fitted
    (:func:`fit_step_costs`). The fitted price is at least the cheapest ratio measured for any option."""
    medians = {key: statistics.median(values) for key, values in ratios.items() if values}
    coefficients = fit_step_costs(ratios, shapes)
    if coefficients is None:
        return medians
    floor = min(min(values) for values in ratios.values() if values)
    prices = {}
    for key, median in medians.items():
        if key not in shapes:
            prices[key] = median
            continue
        fitted = max(floor, 1.0 + float(torch.tensor(step_features(shapes[key]), dtype=torch.float64) @ coefficients))
        count = len(ratios[key])
        prices[key] = (count * median + POOL_WEIGHT * fitted) / (count + POOL_WEIGHT)
    return prices

