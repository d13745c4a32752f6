"""One recorded run: the user's process and its whole tree (process.py), the recording
session every recording path goes through (session.py), its end report (end_report.py) and
``torchdoctor.watch()`` with its Lightning / Hugging Face callbacks (watch.py, integrations.py)."""
