"""The pinned public probe: the inputs every participant embeds to find its latent frame.

Alignment only means something if every participant and the coordinator embed *the same*
inputs. The probe is therefore pinned by hash: :attr:`Probe.probe_hash` covers the inputs
and the landmark subset, and one :attr:`Probe.landmark_hashes` entry per landmark row lets
a participant say exactly which landmark differs when a round announces another probe.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from lensemble_flwr.canonical import digest_arrays
from lensemble_flwr.errors import ProbeError


@dataclasses.dataclass(frozen=True, eq=False)
class Probe:
    """Public probe inputs (n × obs_dim, float32) and the landmark rows among them.

    The constructor keeps a read-only little-endian float32 copy of ``inputs``.

    Raises:
        ProbeError: ``inputs`` is not a non-empty finite 2-D array, or a landmark is out
            of range or repeated.
    """

    inputs: np.ndarray
    landmarks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        raw = np.asarray(self.inputs)
        if raw.ndim != 2 or raw.shape[0] == 0 or raw.shape[1] == 0:
            raise ProbeError(f"probe inputs must be a non-empty n x obs_dim array, got {raw.shape}")
        if not np.issubdtype(raw.dtype, np.number) or not np.all(np.isfinite(raw)):
            raise ProbeError("probe inputs must be finite numbers")
        inputs = np.array(raw, dtype="<f4", copy=True, order="C")
        inputs.setflags(write=False)
        landmarks = tuple(int(i) for i in self.landmarks)
        out_of_range = [i for i in landmarks if not 0 <= i < len(inputs)]
        if out_of_range:
            raise ProbeError(f"landmarks {out_of_range} are not rows of a {len(inputs)}-row probe")
        if len(set(landmarks)) != len(landmarks):
            raise ProbeError(f"landmarks repeat a row: {landmarks}")
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "landmarks", landmarks)

    @property
    def size(self) -> int:
        """n, the number of probe rows."""
        return int(self.inputs.shape[0])

    @functools.cached_property
    def probe_hash(self) -> str:
        """Digest of the inputs and the landmark indices together."""
        return digest_arrays(
            {"inputs": self.inputs, "landmarks": np.asarray(self.landmarks, dtype="<i8")},
            "gauge-probe",
        )

    @functools.cached_property
    def landmark_hashes(self) -> tuple[str, ...]:
        """One digest per landmark, over its index and its input row."""
        return tuple(
            digest_arrays(
                {"index": np.asarray([i], dtype="<i8"), "row": self.inputs[i]},
                "gauge-probe-landmark",
            )
            for i in self.landmarks
        )


def check_pinned(probe: Probe, probe_hash: str, landmark_hashes: tuple[str, ...]) -> None:
    """Refuse a round whose announced probe is not the pinned ``probe``.

    Raises:
        ProbeError: naming what differs (no probe announced, the landmark count, the
            first landmarks that differ, or the probe inputs themselves).
    """
    if not probe_hash:
        raise ProbeError("the round announces no probe, but this participant aligns on one")
    announced = tuple(landmark_hashes)
    if len(announced) != len(probe.landmarks):
        raise ProbeError(
            f"the round announces {len(announced)} landmarks, the pinned probe has "
            f"{len(probe.landmarks)}"
        )
    differing = [
        f"#{k} (row {row})"
        for k, (row, mine, theirs) in enumerate(
            zip(probe.landmarks, probe.landmark_hashes, announced, strict=True)
        )
        if mine != theirs
    ]
    if differing:
        shown = ", ".join(differing[:5]) + (" ..." if len(differing) > 5 else "")
        raise ProbeError(f"landmarks differ from the pinned probe: {shown}")
    if probe_hash != probe.probe_hash:
        raise ProbeError(
            f"probe hash {probe_hash[:12]}... differs from the pinned {probe.probe_hash[:12]}... "
            "(same landmarks: the other probe rows differ)"
        )
