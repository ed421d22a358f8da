"""Whether the server's warm-up has stored the first page's plain readings yet (:data:`FIRST_READINGS`).

The lens check (the canary, about 1 s on the default model) is an extra: it waits for this, so that at launch it
never shares the cores with the readings the first heatmap is drawn from. Standard library only: ``app/serve.py``
clears the event before its warm-up thread starts, before anything heavy is imported; an app run without
``serve.py`` (``streamlit run``, AppTest) finds it set.
"""

from __future__ import annotations

import threading

FIRST_READINGS = threading.Event()
FIRST_READINGS.set()
