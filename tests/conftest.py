"""Session set-up shared by every test module.

Participants keep private state on their own disk (privacy budgets and commitment
secrets, docs/privacy.md); tests keep it in a temporary directory of the session instead
of the user's data directory.
"""

from __future__ import annotations

import os
import tempfile

if "LENSEMBLE_PRIVACY_DIR" not in os.environ:
    os.environ["LENSEMBLE_PRIVACY_DIR"] = tempfile.mkdtemp(prefix="lensemble-test-state-")
