"""kvcopy's command line (``kvcopy calibrate / plan / bench / info``), its benchmark and its plots.
Depends on every room but the integrations; no room imports it."""
