#!/usr/bin/env python
"""PyTorch's torchvision classification reference trainer (references/classification/train.py), as users run it,
written with torch alone (torchvision does not import beside the CPU build of torch here: FACTS 23/44).

    torchrun --standalone --nproc_per_node=4 tests/user_loops/torchvision_train.py --output-dir DIR [--resume PATH]
    torchrun --standalone --nproc_per_node=4 tests/user_loops/torchvision_train_resumable.py --output-dir DIR

Kept from the reference, line for line where it could be: ``init_distributed_mode``, a ``DistributedSampler``, a
``DataLoader`` with workers (not persistent) whose dataset draws random augmentation (crop, flip, brightness, noise:
torch's, Python's and NumPy's global streams) and whose ``collate_fn`` applies mixup or cutmix, chosen at random;
BatchNorm, label smoothing, weight decay off for norm layers, SGD with momentum, a warmup + cosine scheduler stepped
per epoch, an EMA of the weights (``ExponentialMovingAverage``, updated every ``--model-ema-steps`` batches, reset
during warmup), evaluation of the model and the EMA after each epoch, and the reference's checkpoint
(``model``, ``optimizer``, ``lr_scheduler``, ``epoch`` just finished, ``args``, ``model_ema``) with ``--resume``.
Synthetic images stand for ImageFolder. ``torchvision_train_resumable.py`` is the same script with dist_resume: the
recipe of docs/recipe-torchvision.md is the difference (tests/test_recipe.py counts it).
"""

import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate
from torch.utils.data.distributed import DistributedSampler

import dist_resume as dr

NUM_CLASSES = 10


class FakeImages(Dataset):
    """Stands for ImageFolder + ClassificationPresetTrain/Eval: images made from the index, augmented at random."""

    def __init__(self, size, train):
        self.size, self.train = size, train

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        image, target = torch.rand(3, 20, 20, generator=g), index % NUM_CLASSES
        if not self.train:
            return image[:, 2:18, 2:18], target
        top, left = torch.randint(0, 5, (2,)).tolist()  # RandomResizedCrop (torch's stream)
        image = image[:, top : top + 16, left : left + 16]
        if torch.rand(1) < 0.5:  # RandomHorizontalFlip
            image = image.flip(-1)
        image = image * random.uniform(0.8, 1.2)  # ColorJitter (Python's stream)
        image = image + torch.from_numpy(np.random.normal(0, 0.05, image.shape).astype("float32"))  # NumPy's
        return image, target


class RandomMixup:
    def __init__(self, num_classes, alpha=0.2):
        self.num_classes, self.alpha = num_classes, alpha

    def __call__(self, batch, target):
        target = nn.functional.one_hot(target, num_classes=self.num_classes).to(batch.dtype)
        lambda_param = float(torch._sample_dirichlet(torch.tensor([self.alpha, self.alpha]))[0])
        batch = batch.roll(1, 0).mul_(1.0 - lambda_param).add_(batch.mul(lambda_param))
        target = target.roll(1, 0).mul_(1.0 - lambda_param).add_(target.mul(lambda_param))
        return batch, target


class RandomCutmix:
    def __init__(self, num_classes, alpha=1.0):
        self.num_classes, self.alpha = num_classes, alpha

    def __call__(self, batch, target):
        target = nn.functional.one_hot(target, num_classes=self.num_classes).to(batch.dtype)
        lambda_param = float(torch._sample_dirichlet(torch.tensor([self.alpha, self.alpha]))[0])
        h, w = batch.shape[-2:]
        r_x, r_y = torch.randint(w, (1,)), torch.randint(h, (1,))
        r = 0.5 * math.sqrt(1.0 - lambda_param)
        x1, y1 = int(torch.clamp(r_x - r * w, min=0)), int(torch.clamp(r_y - r * h, min=0))
        x2, y2 = int(torch.clamp(r_x + r * w, max=w)), int(torch.clamp(r_y + r * h, max=h))
        batch = batch.clone()
        batch[:, :, y1:y2, x1:x2] = batch.roll(1, 0)[:, :, y1:y2, x1:x2]
        lambda_param = 1.0 - (x2 - x1) * (y2 - y1) / (w * h)
        target = target.roll(1, 0).mul_(1.0 - lambda_param).add_(target.mul(lambda_param))
        return batch, target


def mixup_cutmix_collate(batch):
    mixup_cutmix = random.choice([RandomMixup(NUM_CLASSES), RandomCutmix(NUM_CLASSES)])  # RandomChoice
    return mixup_cutmix(*default_collate(batch))


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """torchvision's references/classification/utils.py."""

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


def make_model():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, NUM_CLASSES),
    )  # fmt: skip


def set_weight_decay(model, weight_decay, norm_weight_decay):
    norm_classes = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)
    params = {"other": [], "norm": []}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            params["norm" if isinstance(module, norm_classes) else "other"].append(p)
    return [
        {"params": params["other"], "weight_decay": weight_decay},
        {"params": params["norm"], "weight_decay": norm_weight_decay},
    ]


def init_distributed_mode(args):
    args.rank, args.world_size, args.gpu = (
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ["LOCAL_RANK"]),
    )
    args.distributed = True
    args.dist_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend=args.dist_backend, init_method="env://", world_size=args.world_size, rank=args.rank)
    dist.barrier()


def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema, scaler, mgr, step):
    model.train()
    for i, (image, target) in enumerate(data_loader):
        image, target = image.to(device), target.to(device)
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if model_ema and step % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < args.lr_warmup_epochs:
                # Reset ema buffer to keep copying weights during warmup period
                model_ema.n_averaged.fill_(0)
        if args.snapshot:
            mgr.snapshot(step)
        if step % args.save_every == 0:
            mgr.save(step)
    return step


def evaluate(model, criterion, data_loader, device):
    model.eval()
    correct = total = 0
    with torch.inference_mode():
        for image, target in data_loader:
            output = model(image.to(device))
            correct += int((output.argmax(1) == target.to(device)).sum())
            total += len(target)
    return correct / max(total, 1)


def main(args):
    init_distributed_mode(args)
    device = torch.device(f"cuda:{args.gpu}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    dataset, dataset_test = FakeImages(args.train_size, train=True), FakeImages(64, train=False)
    train_sampler = dr.ResumableDistributedSampler(dataset, seed=args.seed)
    test_sampler = DistributedSampler(dataset_test, shuffle=False)
    data_loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers, pin_memory=True,
        collate_fn=mixup_cutmix_collate,
    )  # fmt: skip
    data_loader_test = DataLoader(dataset_test, batch_size=args.batch_size, sampler=test_sampler, num_workers=0)

    model = make_model().to(device)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    parameters = set_weight_decay(model, args.weight_decay, norm_weight_decay=0.0)
    optimizer = torch.optim.SGD(parameters, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scaler = None
    main_lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.lr_warmup_epochs)
    warmup_lr_scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=args.lr_warmup_decay, total_iters=args.lr_warmup_epochs
    )
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer, schedulers=[warmup_lr_scheduler, main_lr_scheduler], milestones=[args.lr_warmup_epochs]
    )

    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu] if torch.cuda.is_available() else None)
    model_without_ddp = model.module
    adjust = args.world_size * args.batch_size * args.model_ema_steps / args.epochs
    alpha = min(1.0, (1.0 - args.model_ema_decay) * adjust)
    model_ema = ExponentialMovingAverage(model_without_ddp, device=device, decay=1.0 - alpha)

    mgr = dr.CheckpointManager(args.output_dir, model=model, optimizer=optimizer, scheduler=lr_scheduler,
                               scaler=scaler, dataloader=data_loader, ema=model_ema, keep_last=3)  # fmt: skip
    res = mgr.resume()
    args.start_epoch, step = (res.epoch, res.step) if res is not None else (0, 0)

    for epoch in range(args.start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        step = train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema, scaler, mgr, step)  # fmt: skip
        lr_scheduler.step()
        acc = evaluate(model, criterion, data_loader_test, device=device)
        acc_ema = evaluate(model_ema, criterion, data_loader_test, device=device)
        if args.rank == 0:
            print(f"epoch {epoch}: acc {acc:.3f}, EMA acc {acc_ema:.3f}", flush=True)
        mgr.save(step, extra={"args": vars(args)})
    mgr.close()
    dist.destroy_process_group()


def get_args_parser():
    parser = argparse.ArgumentParser(description="PyTorch Classification Training", add_help=True)
    parser.add_argument("--output-dir", default=".", type=str)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--epochs", default=3, type=int)
    parser.add_argument("-b", "--batch-size", default=8, type=int)
    parser.add_argument("-j", "--workers", default=2, type=int)
    parser.add_argument("--train-size", default=192, type=int)
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("--label-smoothing", default=0.1, type=float)
    parser.add_argument("--lr-warmup-epochs", default=1, type=int)
    parser.add_argument("--lr-warmup-decay", default=0.1, type=float)
    parser.add_argument("--model-ema-steps", default=2, type=int)
    parser.add_argument("--model-ema-decay", default=0.99, type=float)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--save-every", default=5, type=int)
    parser.add_argument("--snapshot", action="store_true", help="a snapshot in host memory after every step")
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
