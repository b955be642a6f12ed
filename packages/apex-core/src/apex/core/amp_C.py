"""``apex.core.amp_C`` is the top-level :mod:`amp_C` module (upstream Apex's name), under apex-core's name."""

import sys

import amp_C

sys.modules[__name__] = amp_C
