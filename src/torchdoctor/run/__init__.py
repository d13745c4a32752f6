"""One recorded run: the user's process (process.py) and the recording session around it (session.py), used by every path that records."""
