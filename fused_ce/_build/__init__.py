"""Build-time tools (AOT kernel compilation). Never imported at run time."""
