"""Wide-ResNet: the bottleneck ResNet of Alpa's Wide-ResNet suite (alpa/model/wide_resnet.py,
itself Flax's ImageNet ResNet v1 with a width factor), in PyTorch's NCHW layout.

Channel layout, ``C`` = ``channels`` (base filters), ``w`` = ``width`` (width factor):

* stem: ``conv 7x7/2, 3 -> C`` (no bias), BatchNorm, ReLU, max-pool 3x3/2;
* stage ``i`` (``i = 0..3``) has ``f = C * 2^i`` filters and ``stages[i]`` bottleneck blocks; the
  first block of stages 1..3 has stride 2 (in its 3x3 conv, ResNet v1.5);
* a bottleneck block: ``conv 1x1, in -> f``, ``conv 3x3, f -> f*w``, ``conv 1x1, f*w -> 4f``, each
  followed by BatchNorm (and ReLU, the last one after the residual add); when the input shape
  differs from the output (first block of every stage), the shortcut is ``conv 1x1/stride,
  in -> 4f`` plus BatchNorm;
* head: global average pool, ``Linear(4 * C * 8, classes)`` with bias; loss = cross-entropy.

This is exactly Alpa's layout (the width factor widens only the 3x3 conv's output, and so the third
conv's input); with it the seven named models of the reference table land within 3% of their names
(wresnet-250m: 254.0 M, -500m: 494.9 M, -1b: 1005.4 M, -2b: 1964.7 M, -4b: 4000.4 M, -6.8b: 6727.4 M,
-13b: 12633.1 M parameters). ``layers`` is the usual bottleneck depth ``3 * sum(stages) + 2``:
50 = [3, 4, 6, 3], 101 = [3, 4, 23, 3], 152 = [3, 8, 36, 3], 200 = [3, 24, 36, 3], plus the small
14 = [1, 1, 1, 1] and 26 = [2, 2, 2, 2] for tests.

BatchNorm does not track running statistics (``track_running_stats=False``): training uses batch
statistics either way, and without buffer updates the traced training step is a pure function of
parameters and batch, with no in-place op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.errors import MeshplanError

__all__ = [
    "STAGE_SIZES",
    "WRESNET_CONFIGS",
    "Bottleneck",
    "WResNetConfig",
    "WideResNet",
    "wresnet_param_count",
]

#: Bottleneck blocks per stage, by depth.
STAGE_SIZES: dict[int, tuple[int, int, int, int]] = {
    14: (1, 1, 1, 1),
    26: (2, 2, 2, 2),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}


@dataclass(frozen=True)
class WResNetConfig:
    """Depth, base channels, width factor, image side and number of classes of a Wide-ResNet."""

    layers: int
    channels: int
    width: int
    image: int = 224
    classes: int = 1000

    def __post_init__(self) -> None:
        for key in ("layers", "channels", "width", "image", "classes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshplanError(
                    f"Wide-ResNet {key} must be a positive integer, got {value!r}"
                )
        if self.layers not in STAGE_SIZES:
            depths = ", ".join(str(d) for d in STAGE_SIZES)
            raise MeshplanError(
                f"Wide-ResNet layers={self.layers} is not supported; accepted depths: {depths}"
            )
        if self.image < 32:
            raise MeshplanError(
                f"Wide-ResNet image must be at least 32 pixels, got {self.image}"
            )

    @property
    def stages(self) -> tuple[int, int, int, int]:
        """Bottleneck blocks in each of the four stages."""
        return STAGE_SIZES[self.layers]


#: The Wide-ResNet sizes of Alpa's end-to-end suite (224x224 images, 1000 classes).
WRESNET_CONFIGS: dict[str, WResNetConfig] = {
    "wresnet-250m": WResNetConfig(layers=50, channels=160, width=2),
    "wresnet-500m": WResNetConfig(layers=50, channels=224, width=2),
    "wresnet-1b": WResNetConfig(layers=50, channels=320, width=2),
    "wresnet-2b": WResNetConfig(layers=50, channels=448, width=2),
    "wresnet-4b": WResNetConfig(layers=50, channels=640, width=2),
    "wresnet-6.8b": WResNetConfig(layers=50, channels=320, width=16),
    "wresnet-13b": WResNetConfig(layers=101, channels=320, width=16),
}


def _block_param_count(cin: int, f: int, w: int) -> int:
    """Parameters of one bottleneck block (convs without bias, BatchNorm weight and bias)."""
    n = cin * f + 2 * f  # conv1 + bn1
    n += 9 * f * f * w + 2 * f * w  # conv2 + bn2
    n += f * w * 4 * f + 2 * 4 * f  # conv3 + bn3
    if cin != 4 * f:
        n += cin * 4 * f + 2 * 4 * f  # shortcut conv + bn
    return n


def wresnet_param_count(config: WResNetConfig) -> int:
    """Closed-form parameter count of ``WideResNet(config)`` (see the module docstring)."""
    c = config.channels
    n = 49 * 3 * c + 2 * c  # stem conv + bn
    cin = c
    for i, blocks in enumerate(config.stages):
        f = c * 2**i
        for _ in range(blocks):
            n += _block_param_count(cin, f, config.width)
            cin = 4 * f
    return n + cin * config.classes + config.classes


def _conv(cin: int, cout: int, k: int, stride: int, dtype: torch.dtype) -> nn.Conv2d:
    return nn.Conv2d(
        cin, cout, k, stride=stride, padding=k // 2, bias=False, dtype=dtype
    )


def _bn(c: int, dtype: torch.dtype) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c, track_running_stats=False, dtype=dtype)


class Bottleneck(nn.Module):
    """A bottleneck block ``1x1 -> 3x3 (widened, strided) -> 1x1`` with a residual shortcut."""

    def __init__(
        self,
        cin: int,
        filters: int,
        width: int,
        stride: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        mid = filters * width
        self.conv1 = _conv(cin, filters, 1, 1, dtype)
        self.bn1 = _bn(filters, dtype)
        self.conv2 = _conv(filters, mid, 3, stride, dtype)
        self.bn2 = _bn(mid, dtype)
        self.conv3 = _conv(mid, 4 * filters, 1, 1, dtype)
        self.bn3 = _bn(4 * filters, dtype)
        self.shortcut: nn.Module | None = None
        if cin != 4 * filters or stride != 1:
            self.shortcut = nn.Sequential(
                _conv(cin, 4 * filters, 1, stride, dtype), _bn(4 * filters, dtype)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[B, cin, H, W] -> [B, 4f, H/stride, W/stride]``."""
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        residual = x if self.shortcut is None else self.shortcut(x)
        return F.relu(y + residual)


class WideResNet(nn.Module):
    """Wide-ResNet classifier; ``forward(images[B, 3, H, W], labels[B])`` returns the mean loss."""

    def __init__(
        self, config: WResNetConfig, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.config = config
        c = config.channels
        self.stem_conv = _conv(3, c, 7, 2, dtype)
        self.stem_bn = _bn(c, dtype)
        blocks = []
        cin = c
        for i, n_blocks in enumerate(config.stages):
            f = c * 2**i
            for j in range(n_blocks):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(Bottleneck(cin, f, config.width, stride, dtype=dtype))
                cin = 4 * f
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, config.classes, dtype=dtype)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the logits of ``images`` against ``labels`` (int64 ``[B]``)."""
        x = F.relu(self.stem_bn(self.stem_conv(images)))
        x = F.max_pool2d(x, kernel_size=3, stride=2, padding=1)
        for block in self.blocks:
            x = block(x)
        x = x.mean(dim=(2, 3))
        return F.cross_entropy(self.fc(x), labels)
