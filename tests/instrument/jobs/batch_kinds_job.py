"""Training and evaluation over DataLoaders of every batch kind the agent counts (a tuple of
tensors, a plain tensor, a dict, a list of strings, a partial last batch), recorded in-process;
prints what the agent recorded, less its times, as one JSON document (test_compiled_path)."""

import json
import sys

import torch

from torchdoctor.instrument.agent import Agent
from torchdoctor.instrument.agent.contract import decode_message, encode_message
from torchdoctor.instrument.wire import decode


class Dicts(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": torch.full((3,), float(i)), "y": torch.tensor([float(i)])}


class Words(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return f"w{i}"


def main() -> None:
    messages = []
    agent = Agent()
    sink = lambda m: messages.append(decode_message(encode_message(m)))  # noqa: E731
    agent.start_session(sink)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pairs = torch.utils.data.TensorDataset(torch.randn(22, 3), torch.randn(22, 1))
    loaders = [
        torch.utils.data.DataLoader(pairs, batch_size=4),  # (x, y), a last batch of 2
        torch.utils.data.DataLoader(torch.randn(12, 3), batch_size=5),  # a tensor
        torch.utils.data.DataLoader(Dicts(), batch_size=3),  # {"x": ..., "y": ...}
    ]
    words = torch.utils.data.DataLoader(Words(), batch_size=4)  # lists of strings
    for _epoch in range(2):
        for loader in loaders:
            for batch in loader:
                if isinstance(batch, dict):
                    x = batch["x"]
                elif isinstance(batch, list):
                    x = batch[0]
                else:
                    x = batch
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
        for _ in words:
            opt.zero_grad()
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
        with torch.no_grad():  # an evaluation between steps
            for x, _y in loaders[0]:
                model(x)
    agent.end_session(sink, True)
    steps = [s for m in messages for s in decode(m).steps]
    settings = {k: json.loads(v) for m in messages for _, k, v in m.get("settings", [])}
    events = [(kind, json.loads(detail)) for m in messages for _, kind, detail in m["events"]]
    evaluations = [
        {k: d[k] for k in ("step", "batches", "samples") if k in d}
        for kind, d in events
        if kind == "evaluation"
    ]
    json.dump(
        {
            "fast_path": settings.get("agent.fast_path"),
            "disabled": agent.disabled_reason,
            "steps": [
                [s.step, s.batch_size, s.samples, s.data_wait_s > 0, s.wall_s > 0] for s in steps
            ],
            "evaluations": evaluations,
            "epochs": [d for kind, d in events if kind == "epoch-start"],
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
