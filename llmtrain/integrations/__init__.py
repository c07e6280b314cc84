"""The tools users already watch runs in (trackers)."""
