"""Probes and probe managers of ``tdhook.latent.probing.managers`` (tdhook 0.1.3).

A `Probe` fits or evaluates one estimator on the values one module produces; a
`ProbeManager` is a ``probe_factory`` for `Probing` that makes one estimator per
``(module, direction)`` and keeps its metrics under ``"{name}_{direction}"``.
`BilinearProbe` and `BilinearProbeManager` do the same for pairs of modules, keyed
``"{h1}_{h2}_{direction}"``. Nothing here computes a number: the estimators and the
user's ``compute_metrics`` do.

Difference from tdhook 0.1.3: a ``step_type`` other than ``"fit"`` or ``"predict"`` is
refused by `BilinearProbe` before the activation is cached (tdhook refuses it only when
the pair is complete).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from tdhook_fn.compat.hooks import HookDirection

__all__ = ["BilinearProbe", "BilinearProbeManager", "Probe", "ProbeManager"]

Callback = Callable[[Any, Any], Any]
_STEP_TYPES = ("fit", "predict")


def _check_step_type(step_type: Any) -> None:
    if step_type not in _STEP_TYPES:
        raise ValueError(f"step_type must be 'fit' or 'predict', got {step_type!r}")


def _flatten_detached(data: Any) -> Any:
    """tdhook's default preprocessing: the values, detached, one row per sample."""
    return data.detach().flatten(1)


class Probe:
    """Fits (``step_type="fit"``) or evaluates (``"predict"``) an estimator on each value.

    Args:
        estimator (Any): has ``fit(X, y=...)`` and ``predict(X)``.
        predict_callback (Callable): ``(predictions, labels)``, after each ``"predict"`` step.
        fit_callback (Callable | None): ``(predictions on the fitted data, labels)``, after
            each ``"fit"`` step.
        data_preprocess_callback (Callable | None): turns the value into ``X``. Default:
            detach and flatten all dims after the first.
    """

    def __init__(
        self,
        estimator: Any,
        predict_callback: Callback,
        fit_callback: Callback | None = None,
        data_preprocess_callback: Callable[[Any], Any] | None = None,
    ) -> None:
        self._estimator = estimator
        self._predict_callback = predict_callback
        self._fit_callback = fit_callback
        self._data_preprocess_callback = data_preprocess_callback or _flatten_detached

    def step(self, data: Any, **kwargs: Any) -> None:
        """Fit or evaluate on ``data``; ``labels`` and ``step_type`` come as keywords."""
        labels, step_type = kwargs.get("labels"), kwargs.get("step_type")
        _check_step_type(step_type)
        data = self._data_preprocess_callback(data)
        self._fit_or_predict(labels, step_type, data)

    def _fit_or_predict(self, labels: Any, step_type: Any, *xs: Any) -> None:
        """Fit on ``xs`` (then the fit callback) or predict on them (then the predict callback)."""
        if step_type == "fit":
            self._estimator.fit(*xs, y=labels)
            if self._fit_callback is not None:
                self._fit_callback(self._estimator.predict(*xs), labels)
        else:
            self._predict_callback(self._estimator.predict(*xs), labels)


class BilinearProbe(Probe):
    """A probe of a bilinear estimator on the values of two modules, ``h1`` and ``h2``.

    When ``h1_key != h2_key`` the first value to arrive is held until the other one
    does; with ``h1_key == h2_key`` the estimator sees the value twice.

    Args:
        h1_key (str): the name of the first module.
        h2_key (str): the name of the second.
        estimator (Any): has ``fit(h1, h2, y=...)`` and ``predict(h1, h2)``.
        predict_callback (Callable): see `Probe`.
        fit_callback (Callable | None): see `Probe`.
        data_preprocess_callback (Callable | None): see `Probe`.
    """

    def __init__(
        self,
        h1_key: str,
        h2_key: str,
        estimator: Any,
        predict_callback: Callback,
        fit_callback: Callback | None = None,
        data_preprocess_callback: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(estimator, predict_callback, fit_callback, data_preprocess_callback)
        self._h1_key = h1_key
        self._h2_key = h2_key
        self._cached: dict[str, Any] = {}
        self._waiting_active = False

    def step(self, data: Any, key: str, labels: Any, step_type: str, **kwargs: Any) -> None:  # type: ignore[override]
        """Take the value of module ``key``; run the estimator once both values are in."""
        _check_step_type(step_type)
        data = self._data_preprocess_callback(data)
        if self._h1_key == self._h2_key:
            self._fit_or_predict(labels, step_type, data, data)
            return
        slot = {self._h1_key: "h1", self._h2_key: "h2"}.get(key)
        if slot is None:
            return
        self._cached[slot] = data
        if "h1" in self._cached and "h2" in self._cached:
            h1, h2 = self._cached.pop("h1"), self._cached.pop("h2")
            self._fit_or_predict(labels, step_type, h1, h2)

    def before_all(self) -> None:
        """Start a run: forget any held value."""
        self._waiting_active = True
        self._cached.clear()

    def after_all(self) -> list[tuple[str, str]]:
        """End a run: ``[(h1_key, h2_key)]`` if a value is still waiting for its partner, else ``[]``."""
        self._waiting_active = False
        waiting = [(self._h1_key, self._h2_key)] if self.is_waiting else []
        self._cached.clear()
        return waiting

    @property
    def is_waiting(self) -> bool:
        """Whether one value of the pair is held and the other has not come."""
        return self._h1_key != self._h2_key and len(self._cached) == 1


class ProbeManager:
    """One estimator per ``(module, direction)``, fitted and evaluated by `Probing`.

    Pass ``manager.probe_factory`` to `Probing` (with ``additional_keys=["labels",
    "step_type"]``); estimators and metrics are keyed ``"{name}_{direction}"``.

    Args:
        estimator_class (Any): called as ``estimator_class(**estimator_kwargs)``.
        estimator_kwargs (dict): its arguments.
        compute_metrics (Callable): ``(predictions, labels) -> metrics``.
        allow_overwrite (bool): replace an existing estimator or metrics instead of
            raising. Default: ``False``.
        data_preprocess_callback (Callable | None): see `Probe`.
    """

    def __init__(
        self,
        estimator_class: Any,
        estimator_kwargs: dict[str, Any],
        compute_metrics: Callable[[Any, Any], dict[str, Any]],
        allow_overwrite: bool = False,
        data_preprocess_callback: Callable[[Any], Any] | None = None,
    ) -> None:
        self._estimator_class = estimator_class
        self._estimator_kwargs = estimator_kwargs
        self._compute_metrics = compute_metrics
        self._allow_overwrite = allow_overwrite
        self._data_preprocess_callback = data_preprocess_callback
        self._estimators: dict[str, Any] = {}
        self._fit_metrics: dict[str, Any] = {}
        self._predict_metrics: dict[str, Any] = {}

    @property
    def estimators(self) -> dict[str, Any]:
        return self._estimators

    @property
    def fit_metrics(self) -> dict[str, Any]:
        return self._fit_metrics

    @property
    def predict_metrics(self) -> dict[str, Any]:
        return self._predict_metrics

    def _new_estimator(self, key: str, hint: str) -> Any:
        if key in self._estimators and not self._allow_overwrite:
            raise ValueError(f"Probe {key} already exists, call reset_estimators() to reset {hint}")
        estimator = self._estimator_class(**self._estimator_kwargs)
        self._estimators[key] = estimator
        return estimator

    def _recorder(self, key: str, which: str, hint: str) -> Callback:
        """A callback storing ``compute_metrics`` in the fit or predict metrics under ``key``."""

        def record(predictions: Any, labels: Any) -> None:
            store = self._fit_metrics if which == "fit" else self._predict_metrics
            if key in store and not self._allow_overwrite:
                raise ValueError(f"Metrics for {key} already exist, call reset_metrics() {hint}")
            store[key] = self._compute_metrics(predictions, labels)

        return record

    def probe_factory(self, key: str, direction: HookDirection) -> Probe:
        """A `Probe` with a new estimator for module ``key`` in ``direction``."""
        name = f"{key}_{direction}"
        estimator = self._new_estimator(
            name, "the estimators or use allow_overwrite=True to overwrite the existing estimators")
        hint = "to reset the metrics or use allow_overwrite=True to overwrite the existing metrics"
        return Probe(estimator, self._recorder(name, "predict", hint), self._recorder(name, "fit", hint),
                     self._data_preprocess_callback)

    def reset_estimators(self) -> None:
        """Forget every estimator."""
        self._estimators = {}

    def reset_metrics(self) -> None:
        """Forget every metric."""
        self._fit_metrics = {}
        self._predict_metrics = {}


class _Dispatcher:
    """The probe `BilinearProbeManager` gives `Probing` for one module: feeds every pair it is in."""

    def __init__(self, key: str, probes: list[BilinearProbe]) -> None:
        self._key = key
        self._probes = probes

    def step(self, data: Any, **kwargs: Any) -> None:
        for probe in self._probes:
            probe.step(data, key=self._key, **kwargs)


class BilinearProbeManager(ProbeManager):
    """One bilinear estimator per pair of modules and direction.

    Pass ``manager.key_pattern`` and ``manager.probe_factory`` to `Probing`; estimators
    and metrics are keyed ``"{h1}_{h2}_{direction}"``. Call ``before_all()`` before a
    run and ``after_all()`` after it: it raises if a pair saw only one of its modules.

    Args:
        pairs (list[tuple[str, str]]): the ``(h1, h2)`` module names.
        estimator_class (Any): called as ``estimator_class(**estimator_kwargs)``; its
            ``fit`` and ``predict`` take ``(h1, h2)``.
        estimator_kwargs (dict): its arguments.
        compute_metrics (Callable): ``(predictions, labels) -> metrics``.
        allow_overwrite (bool): see `ProbeManager`. Default: ``False``.
        data_preprocess_callback (Callable | None): see `Probe`.
    """

    def __init__(
        self,
        pairs: list[tuple[str, str]],
        estimator_class: Any,
        estimator_kwargs: dict[str, Any],
        compute_metrics: Callable[[Any, Any], dict[str, Any]],
        allow_overwrite: bool = False,
        data_preprocess_callback: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(estimator_class, estimator_kwargs, compute_metrics, allow_overwrite,
                         data_preprocess_callback)
        self._pairs = list(pairs)
        self._pair_probes: dict[tuple[str, str, str], BilinearProbe] = {}
        self._key_to_probes: dict[tuple[str, str], list[BilinearProbe]] = {}

    @property
    def key_pattern(self) -> str:
        """Every name in the pairs, sorted, as a regex alternation matching the whole name."""
        names = sorted({name for pair in self._pairs for name in pair})
        return "|".join(re.escape(name) + "$" for name in names)

    def probe_factory(self, key: str, direction: HookDirection) -> Any:
        """A probe handing module ``key``'s values to the probes of every pair it is in."""
        key_dir = (key, direction)
        if key_dir not in self._key_to_probes:
            probes = []
            for h1, h2 in self._pairs:
                if key in (h1, h2):
                    pair_key = (h1, h2, direction)
                    if pair_key not in self._pair_probes:
                        self._pair_probes[pair_key] = self._create_pair_probe(h1, h2, direction)
                    probes.append(self._pair_probes[pair_key])
            self._key_to_probes[key_dir] = probes
        return _Dispatcher(key, self._key_to_probes[key_dir])

    def _create_pair_probe(self, h1: str, h2: str, direction: HookDirection) -> BilinearProbe:
        name = f"{h1}_{h2}_{direction}"
        estimator = self._new_estimator(name, "or use allow_overwrite=True")
        hint = "or use allow_overwrite=True"
        return BilinearProbe(h1, h2, estimator, self._recorder(name, "predict", hint),
                             self._recorder(name, "fit", hint), self._data_preprocess_callback)

    def before_all(self) -> None:
        """Start a run on every pair probe."""
        for probe in self._pair_probes.values():
            probe.before_all()

    def after_all(self) -> None:
        """End a run; raise if a pair is still waiting for one of its modules."""
        waiting = [pair for probe in self._pair_probes.values() for pair in probe.after_all()]
        if waiting:
            keys = sorted({name for pair in waiting for name in pair})
            raise ValueError(
                f"Bilinear probes still waiting on keys: {keys}. Unresolved pairs: {waiting}. Each pair needs both "
                "modules to run in every call: check that key_pattern matches both names"
            )

    def reset_estimators(self) -> None:
        """Forget every estimator and pair probe."""
        super().reset_estimators()
        self._pair_probes.clear()
        self._key_to_probes.clear()
