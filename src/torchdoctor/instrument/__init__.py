"""In-process instrumentation: what only the job itself can tell (steps, data wait, settings).

The bootstrap injected by ``torchdoctor run`` stays inert until the user's code imports torch;
it never imports torch itself. Records travel to the recorder as the plain dataclasses in
:mod:`torchdoctor.instrument.events`.
"""
