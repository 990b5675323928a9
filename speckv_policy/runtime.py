"""Runtime policy: load an exported ONNX policy and decide gamma per step.

Imports only numpy, onnxruntime and the package's pure-Python schema and
feature modules: no scikit-learn, no torch.

Errors are explicit by default. Pass ``fallback_gamma`` to get the
documented safe behaviour instead: any failure (unreadable or corrupt file,
schema mismatch, NaN/inf features, an inference error) makes :meth:`decide`
return ``fallback_gamma`` and emits ONE :class:`PolicyFallbackWarning` per
policy object; generation goes on, and since any gamma is lossless its output
does not change.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .features import as_feature_matrix
from .schema import COMPRESSION_CODES, FEATURE_SETS, FeatureSet

#: What a caller who wants fallbacks is advised to use: HF's classic fixed length.
DEFAULT_FALLBACK_GAMMA = 4
SUPPORTED_FORMAT_VERSION = 1


class PolicyLoadError(RuntimeError):
    """An exported policy file is unreadable, corrupt or of another schema."""


class PolicyFallbackWarning(RuntimeWarning):
    """A runtime policy failed and returned its fallback gamma."""


def _import_ort() -> Any:
    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "speckv_policy.runtime needs onnxruntime: pip install 'speckv-policy[cpu]' "
            "(or 'speckv-policy[cuda]' for onnxruntime-gpu)"
        ) from exc
    return ort


def _resolve_providers(providers: str | Sequence[str], available: Sequence[str]) -> list[str]:
    if isinstance(providers, str):
        key = providers.lower()
        if key == "cpu":
            return ["CPUExecutionProvider"]
        if key == "cuda":
            if "CUDAExecutionProvider" not in available:
                raise PolicyLoadError(
                    "CUDA was requested but onnxruntime offers only "
                    f"{', '.join(available)}; install onnxruntime-gpu (speckv-policy[cuda])"
                )
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        raise ValueError(f"providers must be 'cpu', 'cuda' or a list of provider names, got {providers!r}")
    return list(providers)


class RuntimePolicy:
    """An exported gamma policy, ready to decide.

    Parameters
    ----------
    path : str or PathLike
        The ``.onnx`` file written by ``speckv-export``.
    providers : {'cpu', 'cuda'} or list of str, default='cpu'
        onnxruntime execution providers. ``'cuda'`` raises if the CUDA
        provider is not installed; :attr:`provider` tells which one runs.
    fallback_gamma : int or None, default=None
        ``None``: failures raise. An int: failures return it, with one warning.
    intra_op_num_threads : int, default=1
        onnxruntime threads; one is fastest for a per-step decision.

    Attributes
    ----------
    feature_set : FeatureSet
        The schema the model was trained on (checked against this package's).
    candidates : ndarray of int64
        Gammas the model can return.
    metadata : dict of str to str
        The model's ``speckv.*`` metadata.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        providers: str | Sequence[str] = "cpu",
        fallback_gamma: int | None = None,
        intra_op_num_threads: int = 1,
    ) -> None:
        if fallback_gamma is not None and (not isinstance(fallback_gamma, (int, np.integer)) or fallback_gamma < 0):
            raise ValueError(f"fallback_gamma must be a non-negative int or None, got {fallback_gamma!r}")
        self.path = os.fspath(path)
        self.fallback_gamma = None if fallback_gamma is None else int(fallback_gamma)
        self._warned = False
        self.load_error: Exception | None = None
        self._session: Any = None
        self.metadata: dict[str, str] = {}
        self.candidates = np.empty(0, np.int64)
        self.feature_set: FeatureSet | None = None
        self.provider = "none"
        self._x: np.ndarray | None = None
        try:
            self._load(providers, intra_op_num_threads)
        except (PolicyLoadError, OSError) as exc:
            if self.fallback_gamma is None:
                raise
            self.load_error = exc
            self._fallback(exc)

    # -- loading ---------------------------------------------------------
    def _load(self, providers: str | Sequence[str], threads: int) -> None:
        ort = _import_ort()
        if not os.path.exists(self.path):
            raise PolicyLoadError(f"{self.path}: no such policy file")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        wanted = _resolve_providers(providers, ort.get_available_providers())
        try:
            sess = ort.InferenceSession(self.path, sess_options=opts, providers=wanted)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise PolicyLoadError(f"{self.path}: not a loadable ONNX model ({exc})") from exc
        meta = dict(sess.get_modelmeta().custom_metadata_map)
        self.metadata = {k: v for k, v in meta.items() if k.startswith("speckv.")}
        self._check_metadata()
        names = {i.name for i in sess.get_inputs()}
        outs = {o.name for o in sess.get_outputs()}
        if names != {"features"} or not {"gamma", "values", "expected_tokens"} <= outs:
            raise PolicyLoadError(
                f"{self.path}: expected input 'features' and outputs gamma, values, expected_tokens; "
                f"got inputs {sorted(names)} outputs {sorted(outs)}"
            )
        self._session = sess
        self.provider = sess.get_providers()[0]
        if isinstance(providers, str) and providers.lower() == "cuda" and self.provider != "CUDAExecutionProvider":
            raise PolicyLoadError(f"{self.path}: CUDA was requested but onnxruntime runs it on {self.provider}")
        self._x = np.zeros((1, self.feature_set.n_features), dtype=np.float32)  # type: ignore[union-attr]
        try:  # the first run allocates and plans; pay it at load, not on a decoding step
            sess.run(["gamma"], {"features": self._x})
        except Exception as exc:
            raise PolicyLoadError(f"{self.path}: the model does not run on a feature row ({exc})") from exc

    def _check_metadata(self) -> None:
        m = self.metadata
        need = (
            "speckv.format_version",
            "speckv.feature_set",
            "speckv.feature_names",
            "speckv.feature_schema_version",
            "speckv.candidates",
            "speckv.compression_codes",
        )
        missing = [k for k in need if k not in m]
        if missing:
            raise PolicyLoadError(f"{self.path}: not a speckv-policy export (metadata lacks {', '.join(missing)})")
        if int(m["speckv.format_version"]) > SUPPORTED_FORMAT_VERSION:
            raise PolicyLoadError(
                f"{self.path}: export format {m['speckv.format_version']} is newer than this runtime "
                f"supports ({SUPPORTED_FORMAT_VERSION}); upgrade speckv-policy"
            )
        name = m["speckv.feature_set"]
        fs = FEATURE_SETS.get(name)
        if fs is None:
            raise PolicyLoadError(
                f"{self.path}: unknown feature set {name!r}; this package knows {', '.join(FEATURE_SETS)}"
            )
        names = tuple(json.loads(m["speckv.feature_names"]))
        version = int(m["speckv.feature_schema_version"])
        if names != fs.names or version != fs.version:
            raise PolicyLoadError(
                f"{self.path}: feature schema mismatch for set {name!r}: the model expects "
                f"v{version} {list(names)}, this package computes v{fs.version} {list(fs.names)}"
            )
        codes = json.loads(m["speckv.compression_codes"])
        if codes != COMPRESSION_CODES:
            raise PolicyLoadError(
                f"{self.path}: compression codes {codes} differ from this package's {COMPRESSION_CODES}"
            )
        self.feature_set = fs
        self.candidates = np.asarray(json.loads(m["speckv.candidates"]), dtype=np.int64)

    # -- deciding ----------------------------------------------------------
    def _fallback(self, exc: Exception) -> int:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"speckv policy {self.path} failed ({exc}); using fallback gamma {self.fallback_gamma} "
                "(further failures of this policy are silent)",
                PolicyFallbackWarning,
                stacklevel=3,
            )
        return int(self.fallback_gamma)  # type: ignore[arg-type]

    def _matrix(self, features: Any) -> np.ndarray:
        if self._session is None:
            raise PolicyLoadError(f"{self.path}: policy is not loaded ({self.load_error})")
        X = as_feature_matrix(features, self.feature_set)  # type: ignore[arg-type]
        if not np.all(np.isfinite(X)):
            bad = [self.feature_set.names[j] for j in np.flatnonzero(~np.isfinite(X).all(axis=0))]  # type: ignore[union-attr]
            raise ValueError(f"non-finite feature values (NaN or inf) in: {', '.join(bad)}")
        return X

    def decide(self, features: Any) -> int:
        """Gamma for one step.

        Parameters
        ----------
        features : sequence of float, ndarray (F,) or mapping name -> value
            One step's features, in the model's feature set.

        Returns
        -------
        int
            A gamma from :attr:`candidates` (or the fallback gamma).
        """
        try:
            if self._x is None:
                raise PolicyLoadError(f"{self.path}: policy is not loaded ({self.load_error})")
            if type(features) is np.ndarray and features.dtype == np.float32 and features.shape == self._x.shape[1:]:
                if not np.isfinite(features).all():
                    raise ValueError("non-finite feature values (NaN or inf)")
                self._x[0] = features
                x = self._x
            else:
                x = self._matrix(features)
                if x.shape[0] != 1:
                    raise ValueError(f"decide() takes one step's features, got {x.shape[0]} rows; use decide_batch")
            return int(self._session.run(["gamma"], {"features": x})[0][0])
        except Exception as exc:
            if self.fallback_gamma is None:
                raise
            return self._fallback(exc)

    def decide_batch(self, features: Any) -> np.ndarray:
        """Gamma per row of an ``(n, F)`` matrix or DataFrame (no fallback)."""
        x = self._matrix(features)
        return self._session.run(["gamma"], {"features": x})[0]

    def expected_values(self, features: Any) -> dict[str, np.ndarray]:
        """``gamma``, ``values`` (objective per candidate) and ``expected_tokens``."""
        x = self._matrix(features)
        g, v, e = self._session.run(["gamma", "values", "expected_tokens"], {"features": x})
        return {"gamma": g, "candidates": self.candidates.copy(), "values": v, "expected_tokens": e}

    def __repr__(self) -> str:
        fs = self.feature_set.name if self.feature_set else "?"
        return (
            f"RuntimePolicy({self.path!r}, policy={self.metadata.get('speckv.policy', '?')}, "
            f"feature_set={fs}, candidates={self.candidates.tolist()}, provider={self.provider})"
        )
