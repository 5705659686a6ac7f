"""Every test runs offline: no model or data-set hub is ever contacted (the hub clients read these at import)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
