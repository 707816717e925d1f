"""kvcopy's command line (``kvcopy calibrate / plan / bench / info``), its benchmark and its plots.
Depends on the copy core and kvcopy.policy; neither imports it."""
