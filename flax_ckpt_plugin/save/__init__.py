"""Taking a save: the host snapshot (staging, pinned memory, pieces, write plans), the background commit and its atomic finalization, and its figures."""
