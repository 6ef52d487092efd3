"""The result of one profiled step (``FlopsReport``) and its text table.

Pure data and formatting: nothing here touches a model, hooks or devices, so a report can be
built by hand in tests and printed anywhere.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_COLUMNS = ("Module", "Params", "Fwd FLOPs", "Bwd FLOPs", "% Total", "Fwd latency", "Fwd FLOP/s")
_SUFFIXES = ("", "K", "M", "G", "T", "P", "E")


@dataclass(frozen=True, slots=True)
class ModuleProfile:
    """One module's share of a profiled step.

    Attributes:
        name: fully qualified name relative to the profiled model; ``""`` for the model itself.
        type_name: the module's class name.
        depth: 0 for the model, 1 for its children, and so on.
        params: elements of the distinct parameters in this module and its descendants, at
            full (gathered) size.
        fwd_flops: FLOPs of its forward calls, descendants included.
        bwd_flops: FLOPs of its backward, descendants and activation recomputation included.
        fwd_latency_s: wall time of its forward calls, descendants included (seconds).
        calls: forward calls seen; 0 for a container never called itself (``nn.ModuleList``),
            whose FLOPs and latency are then the sums over its children.
    """

    name: str
    type_name: str
    depth: int
    params: int
    fwd_flops: int
    bwd_flops: int
    fwd_latency_s: float
    calls: int

    @property
    def flops(self) -> int:
        """Forward + backward FLOPs."""
        return self.fwd_flops + self.bwd_flops

    @property
    def fwd_flops_per_s(self) -> float:
        """Achieved forward FLOP/s (0.0 when no time was measured)."""
        return self.fwd_flops / self.fwd_latency_s if self.fwd_latency_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class FlopsReport:
    """Totals and per-module numbers of one profiled step.

    Attributes:
        modules: every module of the model in ``named_modules()`` order (the model first).
        total_params: distinct parameter elements of the model (a tied weight counted once).
        fwd_flops: FLOPs counted while the model's forward ran.
        bwd_flops: FLOPs counted during the model's backward, recomputation included.
        other_flops: FLOPs counted in the profiled span outside both, e.g. a loss computed
            outside the model.
        step_latency_s: wall time of the whole profiled span (seconds).
    """

    modules: tuple[ModuleProfile, ...]
    total_params: int
    fwd_flops: int
    bwd_flops: int
    other_flops: int
    step_latency_s: float

    @property
    def flops(self) -> int:
        """Every FLOP counted in the profiled span: forward + backward + other."""
        return self.fwd_flops + self.bwd_flops + self.other_flops

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s over the whole span (0.0 when no time was measured)."""
        return self.flops / self.step_latency_s if self.step_latency_s > 0 else 0.0

    def module(self, name: str) -> ModuleProfile:
        """The profile of the module with fully qualified name ``name`` (``""``: the model).

        Raises:
            KeyError: no module of that name.
        """
        for profile in self.modules:
            if profile.name == name:
                return profile
        raise KeyError(f"no module named {name!r} in the profiled model")

    def table(self, module_depth: int = -1, top_modules: int = 1, detailed: bool = True) -> str:
        """The report as text: summary, top module types per depth, and the module tree.

        Args:
            module_depth: deepest level shown (0 = the model); -1 shows every level.
            top_modules: module types listed per depth, the most expensive first.
            detailed: append the per-module tree (down to ``module_depth``).

        Returns:
            A multi-line string, no trailing newline.

        Raises:
            ValueError: ``module_depth`` below -1 or ``top_modules`` below 1.
        """
        if module_depth < -1:
            raise ValueError(f"module_depth: got {module_depth}, expected -1 or >= 0")
        if top_modules < 1:
            raise ValueError(f"top_modules: got {top_modules}, expected >= 1")
        shown = [m for m in self.modules if module_depth < 0 or m.depth <= module_depth]
        parts = [self._summary(), self._top_by_depth(shown, top_modules)]
        if detailed:
            parts.append(self._tree(shown))
        return "\n\n".join(parts)

    def _summary(self) -> str:
        rows = [
            ("params", _si(self.total_params)),
            ("fwd FLOPs", _si(self.fwd_flops)),
            ("bwd FLOPs", _si(self.bwd_flops)),
            ("fwd+bwd FLOPs", _si(self.fwd_flops + self.bwd_flops)),
        ]
        if self.other_flops:
            rows.append(("FLOPs outside the model", _si(self.other_flops)))
        rows += [
            ("step latency", _ms(self.step_latency_s)),
            ("achieved FLOP/s", _si(self.flops_per_s, "FLOP/s")),
        ]
        width = max(len(k) for k, _ in rows)
        lines = ["FLOPs profile of one step"] + [f"  {k:<{width}}  {v}" for k, v in rows]
        return "\n".join(lines)

    def _top_by_depth(self, shown: Sequence[ModuleProfile], top_modules: int) -> str:
        # Grouped by class, as DeepSpeed does: "Block x4" says more than "blocks.0".
        groups: dict[tuple[int, str], list[ModuleProfile]] = defaultdict(list)
        for m in shown:
            groups[(m.depth, m.type_name)].append(m)
        rows: list[tuple[str, ...]] = []
        for depth in sorted({d for d, _ in groups}):
            at_depth = [(t, ms) for (d, t), ms in groups.items() if d == depth]
            at_depth.sort(key=lambda item: -sum(m.flops for m in item[1]))
            for type_name, ms in at_depth[:top_modules]:
                flops = sum(m.flops for m in ms)
                rows.append(
                    (
                        str(depth),
                        f"{type_name} x{len(ms)}",
                        _si(sum(m.params for m in ms)),
                        _si(flops),
                        self._share(flops),
                        _ms(sum(m.fwd_latency_s for m in ms)),
                    )
                )
        header = ("Depth", "Module type", "Params", "Fwd+bwd FLOPs", "% Total", "Fwd latency")
        title = f"Top {top_modules} module type(s) per depth by fwd+bwd FLOPs"
        return title + "\n" + _render(header, rows)

    def _tree(self, shown: Sequence[ModuleProfile]) -> str:
        rows = [
            (
                "  " * m.depth
                + (f"{m.name.rsplit('.', 1)[-1]} ({m.type_name})" if m.name else m.type_name),
                _si(m.params),
                _si(m.fwd_flops),
                _si(m.bwd_flops),
                self._share(m.flops),
                _ms(m.fwd_latency_s),
                _si(m.fwd_flops_per_s, "FLOP/s"),
            )
            for m in shown
        ]
        return "Per-module profile\n" + _render(_COLUMNS, rows)

    def _share(self, flops: int) -> str:
        total = self.fwd_flops + self.bwd_flops
        return f"{100.0 * flops / total:.2f}%" if total else "-"


def _si(value: float, unit: str = "") -> str:
    """``1234567`` -> ``"1.23 M"``: three significant digits and a decimal prefix."""
    scaled, index = float(value), 0
    while abs(scaled) >= 1000 and index < len(_SUFFIXES) - 1:
        scaled, index = scaled / 1000, index + 1
    number = f"{scaled:.0f}" if index == 0 and scaled == int(scaled) else f"{scaled:.3g}"
    return f"{number} {_SUFFIXES[index]}{unit}".rstrip()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _render(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Fixed-width columns: the first left-aligned, the rest right-aligned."""
    table = [tuple(header), *(tuple(r) for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for row in table:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
