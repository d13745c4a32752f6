"""In-process instrumentation: what only the job itself can tell (steps, data wait, settings).

- :mod:`~torchdoctor.instrument.agent` runs inside the job (standard library only): waits for
  torch to be imported, hooks it, batches records and ships them;
- ``bootstrap/sitecustomize.py`` arms the agent in every Python process of a job started by
  ``torchdoctor run``, loading it when the process first looks torch up (it never imports torch
  itself);
- :mod:`~torchdoctor.instrument.collector` is the recorder's end of the socket;
- :mod:`~torchdoctor.instrument.wire` turns messages into the records of
  :mod:`~torchdoctor.recording.records`;
- ``torchdoctor.watch()``, the in-process API, and its Lightning and Hugging Face callbacks
  live with the recorded run (:mod:`~torchdoctor.run.watch`, :mod:`~torchdoctor.run.integrations`):
  they open a recording session, which is a floor above this one.

The records themselves and the step figures computed from them belong to the recording
(:mod:`~torchdoctor.recording.records`, :mod:`~torchdoctor.recording.steps`): instrumentation
produces them, and the recording, diagnosis, report and top read them without instrument/.
"""
