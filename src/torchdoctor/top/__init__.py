"""The live view (``torchdoctor top``): readings -> view model -> terminal or JSON."""
