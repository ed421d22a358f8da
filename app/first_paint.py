"""How far the server's warm-up is: the model loaded (:data:`MODEL_READY`), the first page's plain readings stored
(:data:`FIRST_READINGS`).

The lens check (the canary, about 1 s on the default model) is an extra: it waits for this, so that at launch it
never shares the cores with the readings the first heatmap is drawn from. Standard library only: ``app/serve.py``
clears the events before its warm-up thread starts, before anything heavy is imported; an app run without
``serve.py`` (``streamlit run``, AppTest) finds them set. While the model loads, a session's first run may draw the
last launch's first heatmap (``launch_snapshot``).
"""

from __future__ import annotations

import threading

MODEL_READY = threading.Event()
MODEL_READY.set()
FIRST_READINGS = threading.Event()
FIRST_READINGS.set()
