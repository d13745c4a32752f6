"""The recording: one SQLite file per run. See :mod:`torchdoctor.recording.reader` for the API."""

from torchdoctor.recording.paths import claim_recording_file, create_recording_file
from torchdoctor.recording.reader import Recording, open_recording
from torchdoctor.recording.writer import RecordingWriter

__all__ = [
    "Recording",
    "RecordingWriter",
    "claim_recording_file",
    "create_recording_file",
    "open_recording",
]
