"""`python -m trainpkg`: the same loop as train_job.py, started as a package."""

import torch

model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters())
data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
for x, y in torch.utils.data.DataLoader(data, batch_size=5):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("package done")
