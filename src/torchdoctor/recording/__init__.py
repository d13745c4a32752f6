"""The recording: one SQLite file per run. See :mod:`torchdoctor.recording.reader` for the API."""

from torchdoctor.recording.reader import Recording, open_recording
from torchdoctor.recording.writer import RecordingWriter, prepare_output

__all__ = ["Recording", "RecordingWriter", "open_recording", "prepare_output"]
