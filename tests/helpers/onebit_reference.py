"""Independent one-process references for the 1-bit optimizers.

N simulated workers each compute the gradient of their own micro-batches of the global
batch; DeepSpeed's algorithms (1-bit Adam, 0/1 Adam, 1-bit LAMB) are written out here per
parameter and per worker, as DeepSpeed writes them, and the compressed all-reduce element by
element from its description (worker: error feedback, one scale per scale group, signs;
server: average of its chunk, its own error, one scale per group within the chunk). What
zerotrain adds is reproduced too: clipping in the compressed phase uses the quadratic mean of
the workers' gradient norms.

Only the packing of the parameters into one flat buffer is taken from the engine (its unit's
parameter order and padding): the reference must cut the same chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tests.helpers.training import RunSpec, global_batches, make_model, micro_batch
from zerotrain.utils.norms import squared_norm


@dataclass(frozen=True)
class Packing:
    """The engine's flat buffer: parameter names in order and the padded length."""

    names: tuple[str, ...]
    padded: int


def compressed_average(
    xs: list[torch.Tensor],
    worker_errors: list[torch.Tensor],
    server_errors: list[torch.Tensor],
    groups: list[tuple[int, int]],
) -> torch.Tensor:
    """The 1-bit average of the workers' flat ``xs`` (error buffers updated in place);
    ``groups`` are the scale groups' ``[start, end)`` (covering the buffer)."""
    n = len(xs)
    size = xs[0].numel()
    chunk = size // n
    sent = []
    for w in range(n):
        x = xs[w] + worker_errors[w]
        c = torch.empty_like(x)
        for start, end in groups:
            part = x[start:end]
            scale = float(squared_norm(part).sqrt() / math.sqrt(end - start))
            c[start:end] = torch.where(part >= 0, scale, -scale)
        worker_errors[w].copy_(x - c)
        sent.append(c)
    out = torch.empty(size)
    for j in range(n):
        lo, hi = j * chunk, (j + 1) * chunk
        avg = sum(s[lo:hi] for s in sent) / n + server_errors[j]
        for start, end in groups:
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            part = avg[a - lo : b - lo]
            scale = float(squared_norm(part).sqrt() / math.sqrt(b - a))
            out[a:b] = torch.where(part >= 0, scale, -scale)
        server_errors[j].copy_(avg - out[lo:hi])
    return out


class Workers:
    """N copies of the tiny GPT, each training on its own share of the global batch."""

    def __init__(self, spec: RunSpec, world: int, packing: Packing) -> None:
        self.spec, self.world, self.packing = spec, world, packing
        self.models = [make_model(spec) for _ in range(world)]
        self.batches = global_batches(spec, world)
        params = dict(self.models[0].named_parameters())
        self.spans = []
        at = 0
        for name in packing.names:
            self.spans.append((at, at + params[name].numel()))
            at += params[name].numel()
        self.numel = at
        self.groups = [*self.spans, (at, packing.padded)] if at < packing.padded else self.spans

    def flat(self, w: int) -> torch.Tensor:
        """Worker ``w``'s parameters, packed and padded."""
        params = dict(self.models[w].named_parameters())
        out = torch.zeros(self.packing.padded)
        for (a, b), name in zip(self.spans, self.packing.names, strict=True):
            out[a:b] = params[name].detach().reshape(-1)
        return out

    def load(self, w: int, flat: torch.Tensor) -> None:
        params = dict(self.models[w].named_parameters())
        with torch.no_grad():
            for (a, b), name in zip(self.spans, self.packing.names, strict=True):
                params[name].copy_(flat[a:b].view(params[name].shape))

    def gradients(self, step: int) -> tuple[list[torch.Tensor], float]:
        """Each worker's gradient of its micro-batches (mean over them, packed), and the
        mean loss over every micro-batch."""
        grads, total = [], 0.0
        gas = self.spec.grad_accum
        for w, model in enumerate(self.models):
            model.zero_grad(set_to_none=True)
            for micro in range(gas):
                x, y = micro_batch(self.batches, self.spec, step, micro, w, self.world)
                loss = model(x, y)
                (loss / gas).backward()
                total += loss.item()
            params = dict(model.named_parameters())
            g = torch.zeros(self.packing.padded)
            for (a, b), name in zip(self.spans, self.packing.names, strict=True):
                if params[name].grad is not None:
                    g[a:b] = params[name].grad.reshape(-1)
            grads.append(g)
        return grads, total / (self.world * gas)

    def named(self, w: int = 0) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.models[w].named_parameters()}


# The arithmetic below follows the engine's operation by operation (an fp32 clip factor,
# moments updated as ``m * b1 + (1 - b1) * g`` in one fused step): Adam without bias
# correction divides by sqrt(v) + eps with v tiny in early steps, which would turn rounding
# differences alone into visible ones.


def _clip_coef(squares: torch.Tensor, clip: float) -> torch.Tensor:
    norm = squares.sqrt().float()
    return (clip / (norm + 1e-6)).clamp(max=1.0)


def _clip_averaged(avg: torch.Tensor, clip: float) -> torch.Tensor:
    return avg * _clip_coef(squared_norm(avg), clip) if clip > 0 else avg


def _clip_local(grads: list[torch.Tensor], clip: float) -> list[torch.Tensor]:
    """The engine's clip with each rank's own gradient: one factor for every rank, from the
    quadratic mean of their norms."""
    if clip <= 0:
        return grads
    total = torch.stack([squared_norm(g) for g in grads]).sum() / len(grads)
    coef = _clip_coef(total, clip)
    return [g * coef for g in grads]


def _ema(m: torch.Tensor, g: torch.Tensor, beta: float) -> torch.Tensor:
    return m.mul(beta).add_(g, alpha=1 - beta)


def _ema_sq(v: torch.Tensor, g: torch.Tensor, beta: float) -> torch.Tensor:
    return v.mul(beta).addcmul_(g, g, value=1 - beta)


def _update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, eps: float, wd: float):
    update = m / v.sqrt().add_(eps)
    return update.add_(p, alpha=wd) if wd > 0 else update


def _errors(workers: Workers) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    n, size = workers.world, workers.packing.padded
    return [torch.zeros(size) for _ in range(n)], [torch.zeros(size // n) for _ in range(n)]


def onebit_adam(spec: RunSpec, world: int, packing: Packing, freeze_step: int) -> dict[str, Any]:
    """DeepSpeed's 1-bit Adam on ``world`` simulated workers (one param group)."""
    o = spec.opt_params
    lr, wd, eps = o["lr"], o.get("weight_decay", 0.0), o.get("eps", 1e-8)
    b1, b2 = o.get("betas", (0.9, 0.999))
    workers = Workers(spec, world, packing)
    p = workers.flat(0)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    werr, serr = _errors(workers)
    losses = []
    for t in range(1, spec.steps + 1):
        grads, loss = workers.gradients(t - 1)
        losses.append(loss)
        if t - 1 >= max(freeze_step, 2):  # compressed: own gradients, momentum averaged
            grads = _clip_local(grads, spec.clip)
            xs = [_ema(m, g, b1) for g in grads]
            m = compressed_average(xs, werr, serr, workers.groups) if world > 1 else xs[0]
        else:
            g = _clip_averaged(sum(grads) / world, spec.clip)
            m = _ema(m, g, b1)
            v = _ema_sq(v, g, b2)
            if t == 1:
                continue  # DeepSpeed's first step only initialises
        p = p.add(_update(p, m, v, eps, wd), alpha=-lr)
        for w in range(world):
            workers.load(w, p)
    return {"losses": losses, "params": workers.named()}


def zero_one_adam(spec: RunSpec, world: int, packing: Packing, **schedule: int) -> dict[str, Any]:
    """DeepSpeed's 0/1 Adam on ``world`` simulated workers (one param group)."""
    o = spec.opt_params
    lr, wd, eps = o["lr"], o.get("weight_decay", 0.0), o.get("eps", 1e-8)
    b1, b2 = o.get("betas", (0.9, 0.999))
    var_freeze, var_scaler = schedule["var_freeze_step"], schedule["var_update_scaler"]
    local_scaler, clipper = schedule["local_step_scaler"], schedule["local_step_clipper"]
    workers = Workers(spec, world, packing)
    ps = [workers.flat(w) for w in range(world)]
    ms = [torch.zeros_like(ps[0]) for _ in range(world)]
    v = torch.zeros_like(ps[0])
    accs = [torch.zeros_like(ps[0]) for _ in range(world)]
    werr, serr = _errors(workers)
    var_interval, var_counter, local_interval, local_counter, lrs = 1, 0, 1, 0, 0.0
    frozen, reset = False, False
    losses = []
    for t in range(1, spec.steps + 1):
        grads, loss = workers.gradients(t - 1)
        losses.append(loss)
        if t == 1:
            continue
        if not frozen:
            if t % var_interval == 0:
                g = _clip_averaged(sum(grads) / world, spec.clip)
                ms = [_ema(m, g, b1) for m in ms]
                v = _ema_sq(v, g, b2)
                var_counter += 1
                if var_counter == var_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            else:
                grads = _clip_local(grads, spec.clip)
                g = compressed_average(grads, werr, serr, workers.groups) if world > 1 else grads[0]
                ms = [_ema(m, g, b1) for m in ms]
            ps = [p.add(_update(p, m, v, eps, wd), alpha=-lr) for p, m in zip(ps, ms, strict=True)]
        else:
            grads = _clip_local(grads, spec.clip)
            ms = [_ema(m, g, b1) for m, g in zip(ms, grads, strict=True)]
            lrs += lr
            for w in range(world):
                update = _update(ps[w], ms[w], v, eps, wd).mul_(-lr)
                ps[w] = ps[w] + update
                accs[w] = accs[w] + update
            if t % local_interval == 0:
                denom = v.sqrt().add_(eps)
                for w in range(world):
                    ps[w] = ps[w] - accs[w]
                scaled = [a * denom for a in accs]
                if world > 1:
                    avg = compressed_average(scaled, werr, serr, workers.groups)
                else:
                    avg = scaled[0]
                ms = [avg / -lrs for _ in range(world)]
                ps = [p + avg / v.sqrt().add_(eps) for p in ps]
                accs = [torch.zeros_like(a) for a in accs]
                lrs = 0.0
            local_counter += 1
            if local_counter == local_scaler:
                local_counter, local_interval = 0, min(clipper, local_interval * 2)
        if t > var_freeze:
            frozen = True
            if not reset:
                for e in (*werr, *serr):
                    e.zero_()
                reset = True
        for w in range(world):
            workers.load(w, ps[w])
    return {
        "losses": losses,
        "params": workers.named(),
        "params_by_worker": [workers.named(w) for w in range(world)],
    }


def onebit_lamb(spec: RunSpec, world: int, packing: Packing, **options: float) -> dict[str, Any]:
    """DeepSpeed's 1-bit LAMB on ``world`` simulated workers (one param group)."""
    o = spec.opt_params
    lr, wd, eps = o["lr"], o.get("weight_decay", 0.0), o.get("eps", 1e-8)
    b1, b2 = o.get("betas", (0.9, 0.999))
    freeze = int(options["freeze_step"])
    max_coeff, min_coeff = options.get("max_coeff", 10.0), options.get("min_coeff", 0.01)
    coeff_beta = options.get("coeff_beta", 0.9)
    factor_max, factor_min = options.get("factor_max", 4.0), options.get("factor_min", 0.5)
    threshold = options.get("factor_threshold", 0.1)
    workers = Workers(spec, world, packing)
    spans = workers.spans
    p = workers.flat(0)
    m, v, fresh = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    lcf = [0.0] * len(spans)
    last = [1.0] * len(spans)
    scaling: list[float] | None = None
    werr, serr = _errors(workers)
    # One scale for the whole model (DeepSpeed fuses every momentum into one buffer).
    groups = [(0, workers.numel)] + (
        [(workers.numel, packing.padded)] if workers.numel < packing.padded else []
    )
    losses = []

    def norm(t: torch.Tensor) -> float:
        return float(squared_norm(t).sqrt())

    for t in range(1, spec.steps + 1):
        grads, loss = workers.gradients(t - 1)
        losses.append(loss)
        if t == 1:
            continue
        new = p.clone()
        if t - 1 >= max(freeze, 2):
            m_last = m.clone()
            if scaling is None:
                scales = [norm(m[a:b]) / math.sqrt(b - a) for a, b in spans]
                united = sum(scales) / len(scales)
                scaling = [united / s if s > 0 else 1.0 for s in scales]
            grads = _clip_local(grads, spec.clip)
            xs = []
            for g in grads:
                x = _ema(m, g, b1)
                for (a, b), c in zip(spans, scaling, strict=True):
                    x[a:b] *= c
                xs.append(x)
            m = compressed_average(xs, werr, serr, groups) if world > 1 else xs[0]
            for (a, b), c in zip(spans, scaling, strict=True):
                m[a:b] /= c
            for k, (a, b) in enumerate(spans):
                implied = (m[a:b] - m_last[a:b] * b1) / (1 - b1)
                fresh[a:b] = _ema_sq(fresh[a:b], implied, b2)
                denom = v[a:b].sqrt().add_(eps)
                prelim = m[a:b] / denom
                update = prelim.clone()
                if wd > 0:
                    update.add_(p[a:b], alpha=wd)
                factor = float(denom.div_(fresh[a:b].sqrt().add_(eps)).max())
                if wd > 0:
                    u = norm(update)
                    ratio = min(1.0, norm(prelim) / u) if u > 0 else 1.0
                    factor = factor * ratio + (1.0 - ratio)
                factor = min(max(factor, factor_min), factor_max)
                factor = min(max(factor, last[k] * (1 - threshold)), last[k] * (1 + threshold))
                last[k] = factor
                new[a:b] = p[a:b].add(update, alpha=-lr * lcf[k] * factor)
        else:
            g = _clip_averaged(sum(grads) / world, spec.clip)
            m = _ema(m, g, b1)
            v = _ema_sq(v, g, b2)
            if t == freeze:
                fresh = v.clone()
            for k, (a, b) in enumerate(spans):
                update = _update(p[a:b], m[a:b], v[a:b], eps, wd)
                w_norm, u_norm = norm(p[a:b]), norm(update)
                coeff = 1.0
                if w_norm > 0 and u_norm > 0:
                    coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
                if coeff != 1.0:
                    lcf[k] = coeff_beta * lcf[k] + (1 - coeff_beta) * coeff
                new[a:b] = p[a:b].add(update, alpha=-lr * coeff)
        p = new
        for w in range(world):
            workers.load(w, p)
    return {"losses": losses, "params": workers.named()}
