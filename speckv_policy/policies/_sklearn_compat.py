"""The one place that touches scikit-learn's private API.

scikit-learn's parameter-constraint objects (``Interval``, ``StrOptions``) live
in the private module ``sklearn.utils._param_validation``; scikit-learn's own
estimators and its developer guide use them, but the module may move. Every
policy imports them from here, so a move is a one-line fix.
"""

from __future__ import annotations

try:
    from sklearn.utils._param_validation import Interval, StrOptions  # noqa: PLC2701 (the one place)
except ImportError as exc:  # pragma: no cover - only on a scikit-learn that moved them
    import sklearn

    raise ImportError(
        f"speckv-policy needs scikit-learn's parameter constraints (sklearn.utils._param_validation); "
        f"scikit-learn {sklearn.__version__} does not have them. Tested with scikit-learn >= 1.6."
    ) from exc

__all__ = ["Interval", "StrOptions"]
