"""Hand-off beyond Slurm: the same sizing (``torchdoctor.sizing``) rendered for Ray and Kubernetes.

``kube`` writes TrainJob (Kubeflow Trainer v2), PyTorchJob (training-operator 1.9) and batch/v1
Job manifests and checks the rules no schema says; ``yaml_text`` writes them, every value
validated and quoted for YAML, each sized figure with its source as a comment; ``validate``
reads the written text back and checks it strictly against the API models the projects
publish on PyPI; ``ray_job`` submits to a Ray cluster's job API and reads a job back;
``ray_nodes`` is the entrypoint that places one torchrun per node for a job of several nodes.
"""
