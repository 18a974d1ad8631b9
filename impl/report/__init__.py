"""Tables (pandas) and figures (matplotlib) built from raw result rows only, and REPORT.md."""
