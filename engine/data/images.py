"""Images for the vision tower: load, resize to the checkpoint's dynamic resolution, normalise, cut into patches.

The settings are the checkpoint's own (preprocessor_config.json of Qwen2-VL-style processors, as qwen3_5_moe and
qwen4_exp ship them): each image is resized so both sides are multiples of patch_size * merge_size and its area
lies within [min_pixels, max_pixels] (aspect ratio kept), rescaled to [0, 1], normalised by mean/std, and cut into
patches of C x temporal_patch_size x patch_size x patch_size values (a still image repeats over the temporal
patch), ordered so that each merge_size x merge_size block of neighbouring patches is contiguous (the patch merger
folds exactly those into one language-model token).

Shapes: P patches of one image, C channels, Tp temporal patch, p patch size, m merge size.
"""

from __future__ import annotations

import json
import math
import os
import stat
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe_tune.profiles import error_line
from moe_tune.profiles.schema import file_kind

# Pillow's own decompression-bomb bound (Image.MAX_IMAGE_PIXELS), fixed here so a process that lifts Pillow's global
# still refuses them: 89.5 M pixels decode to ~270 MB of RGB; every image is downscaled to max_pixels anyway.
MAX_IMAGE_PIXELS = int(1024 * 1024 * 1024 // 4 // 3)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the processor's default resample


class ImageError(ValueError):
    """An image that cannot be used: unreadable, missing, or of an unusable shape. The message names the file."""


@dataclass(frozen=True)
class ImageSettings:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = BICUBIC

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_checkpoint(cls, directory: Path) -> ImageSettings:
        """The image processor settings saved beside a checkpoint (preprocessor_config.json), read as transformers'
        Qwen2-VL image processor reads them; defaults otherwise. ImageError for a setting it cannot follow."""
        path = Path(directory) / "preprocessor_config.json"
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise ImageError(f"{path}: cannot read the image processor settings ({err})") from None
        if not isinstance(raw, dict):
            raise ImageError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
        size = raw.get("size") or {}
        if not isinstance(size, dict):
            raise ImageError(f"{path}: size ({size!r}) must be an object with shortest_edge and longest_edge")
        if raw.get("do_resize") is False:
            raise ImageError(f"{path}: do_resize (false) is not followed: images are always resized to the patch grid")
        default = cls()

        def pick(*values, fallback):
            return next((v for v in values if v is not None), fallback)

        def per_channel(key, fallback):
            value = raw.get(key, fallback)
            value = (value,) * 3 if isinstance(value, (int, float)) else tuple(value)
            if len(value) != 3:
                raise ImageError(f"{path}: {key} ({list(value)}) must give one value per RGB channel (3)")
            return tuple(float(v) for v in value)

        mean, std = per_channel("image_mean", default.image_mean), per_channel("image_std", default.image_std)
        if raw.get("do_normalize") is False:
            mean, std = (0.0,) * 3, (1.0,) * 3
        rescale = 1.0 if raw.get("do_rescale") is False else pick(raw.get("rescale_factor"), fallback=1 / 255)
        settings = cls(
            patch_size=int(raw.get("patch_size", default.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", default.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", default.merge_size)),
            # Top-level min/max_pixels win over size, as in transformers; size's min/max_pixels are the older spelling.
            min_pixels=int(pick(raw.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels"),
                                fallback=default.min_pixels)),
            max_pixels=int(pick(raw.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels"),
                                fallback=default.max_pixels)),
            image_mean=mean,
            image_std=std,
            rescale_factor=float(rescale),
            resample=int(pick(raw.get("resample"), fallback=BICUBIC)),
        )
        if problem := settings_problem(settings):
            raise ImageError(f"{path}: {problem}")
        return settings


# PIL.Image.Resampling: NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING.
RESAMPLING = range(6)


def settings_problem(settings: ImageSettings, names: dict[str, str] | None = None) -> str | None:
    """The first setting images cannot be read with (its name, value and rule), or None: patch and merge sizes of
    at least 1, pixel bounds with 0 <= min_pixels <= max_pixels <= MAX_IMAGE_PIXELS (past it a 1-pixel image could be
    resized to gigabytes), a nonzero finite std per channel, a finite rescale factor, a resampling filter Pillow has.
    `names`: how to name a setting that came from elsewhere (`{"min_pixels": "data.image_min_pixels"}`)."""
    low, high = (f"{(names or {}).get(key, key)} ({getattr(settings, key)})" for key in ("min_pixels", "max_pixels"))
    for name in ("patch_size", "temporal_patch_size", "merge_size"):
        if getattr(settings, name) < 1:
            return f"{name} ({getattr(settings, name)}) must be >= 1"
    if not 0 <= settings.min_pixels <= settings.max_pixels:
        return f"{low} must be >= 0 and <= {high}"
    if not 1 <= settings.max_pixels <= MAX_IMAGE_PIXELS:
        return f"{high} must be in [1, {MAX_IMAGE_PIXELS}] (Pillow's bound on an image)"
    if not all(math.isfinite(s) and s != 0 for s in settings.image_std):
        return f"image_std ({list(settings.image_std)}) must be finite and nonzero for each channel"
    if not all(math.isfinite(v) for v in (*settings.image_mean, settings.rescale_factor)):
        return f"image_mean ({list(settings.image_mean)}) and rescale_factor ({settings.rescale_factor}) must be finite"
    if settings.resample not in RESAMPLING:
        return f"resample ({settings.resample}) must be one of Pillow's filters, 0 to 5"
    return None


def target_size(height: int, width: int, settings: ImageSettings) -> tuple[int, int]:
    """The resized (height, width): multiples of patch_size * merge_size, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as the grid allows."""
    factor = settings.factor
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"aspect ratio {max(height, width) / min(height, width):.4g} must be <= 200")
    # A side under factor / 2 rounds to 0, so the area is below min_pixels and the image is scaled up: as
    # transformers' smart_resize, whose grid and token count inference sees.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > settings.max_pixels:
        beta = math.sqrt((height * width) / settings.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < settings.min_pixels:
        beta = math.sqrt(settings.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    # min_pixels 0 leaves a rounded-down side at 0: one factor is the least a side can be.
    return max(factor, h_bar), max(factor, w_bar)


def load_image(path: Path, links: bool = True):
    """An RGB PIL image; ImageError naming the file when it is missing, not a regular file (a FIFO, device or
    directory is never opened), larger than MAX_IMAGE_PIXELS (checked on the header, before decoding), of a format
    whose decoder runs another program (EPS), or not a (whole) image. Animated and multi-page files give their first
    frame, as in transformers.

    links=False: `path` is a real path (resolve_image_path's, checked inside its data folder) and is opened one
    folder at a time following no symbolic link, so a folder or file swapped for a link since the check (a data
    folder changed while a run reads its images again) is refused, not followed out of the folder."""
    try:
        from PIL import Image, ImageOps, UnidentifiedImageError
    except ImportError:
        raise ImageError(f"{path}: reading images needs Pillow: pip install pillow") from None
    try:
        # Stat first: opening some devices acts on them. Then open without blocking (a FIFO swapped in meanwhile
        # would wait for a writer) and check what was opened.
        fd = _open_regular(path) if links or not LINK_FREE_OPEN else _open_regular_without_links(path)
    except ImageError:
        raise
    except FileNotFoundError:
        raise ImageError(f"{path}: no such image file") from None
    except (OSError, ValueError) as err:
        raise ImageError(f"{path}: cannot be read ({getattr(err, 'strerror', None) or err})") from None
    with os.fdopen(fd, "rb") as f, _pillow_rules():
        _check_regular(os.fstat(fd).st_mode, path)
        try:
            with Image.open(f) as img:
                if img.width * img.height > MAX_IMAGE_PIXELS:
                    raise ImageError(f"{path}: {img.width} x {img.height} pixels, more than the "
                                     f"{MAX_IMAGE_PIXELS} an image may have (a decompression bomb?)")
                if img.format == "EPS":
                    # Pillow decodes PostScript by running Ghostscript on it: a data file would run a program.
                    raise ImageError(f"{path}: an EPS file, which Pillow decodes by running Ghostscript on its "
                                     "PostScript: not read; save it as PNG or JPEG")
                img.load()
                _check_depth(img, path)
                # As transformers' load_image: a photo's EXIF orientation applied, so it is not trained sideways.
                img = ImageOps.exif_transpose(img)
                if "A" in img.getbands() or "transparency" in img.info:
                    # As transformers' convert_to_rgb: transparent pixels over white, not their hidden colour.
                    rgba = img.convert("RGBA")
                    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                    return Image.alpha_composite(background, rgba).convert("RGB")
                return img.convert("RGB")
        except ImageError:
            raise
        except Exception as err:  # noqa: BLE001 - Pillow's decoders raise many types on malformed files
            # UnidentifiedImageError's message repeats the file; others say what broke (a truncated file).
            detail = type(err).__name__ if isinstance(err, UnidentifiedImageError) else error_line(err, ())
            raise ImageError(f"{path}: not a readable image ({detail})") from None


_PILLOW_GLOBALS = threading.Lock()


@contextmanager
def _pillow_rules():
    """Pillow's process-wide switches held at this module's rules while one image is read, whatever another library
    set: no bomb check of Pillow's own (MAX_IMAGE_PIXELS is checked on the header, naming the size, even where
    Pillow's bound was lowered or lifted) and truncated files refused (LOAD_TRUNCATED_IMAGES off)."""
    from PIL import Image, ImageFile

    with _PILLOW_GLOBALS:
        saved = Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES
        Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = None, False
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = saved


# Pillow's modes of pixels wider than 8 bits: 16-bit and 32-bit integers, 32-bit floats.
_WIDE_MODES = ("I", "I;16", "I;16L", "I;16B", "I;16N", "F")


def _check_depth(img, path: Path) -> None:
    """Refuse pixels wider than 8 bits whose values leave 0..255: converting to 8-bit RGB (here and in transformers'
    loader) clips them, so a 16-bit scan turns white."""
    if img.mode not in _WIDE_MODES:
        return
    low, high = img.getextrema()
    if low < 0 or high > 255:
        raise ImageError(f"{path}: mode {img.mode} pixels range over {low:.6g}..{high:.6g}; 8-bit RGB keeps 0..255 and "
                         "clips the rest (a 16-bit image turns white): save it as an 8-bit image")


# Opening relative to a folder's descriptor with O_NOFOLLOW (POSIX); elsewhere links=False opens as links=True does.
LINK_FREE_OPEN = os.open in os.supports_dir_fd and hasattr(os, "O_NOFOLLOW") and hasattr(os, "O_DIRECTORY")
# The folders on the way are opened to look up names in (Linux's O_PATH needs no read permission on them, as a plain
# open through a folder of mode 711 needs none).
_SEARCH = getattr(os, "O_PATH", os.O_RDONLY)


def _open_regular(path: Path) -> int:
    _check_regular(os.stat(path).st_mode, path)
    return os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))


def _open_regular_without_links(path: Path) -> int:
    parts = Path(path).parts
    if parts[0] != os.sep or ".." in parts:
        raise ImageError(f"{path}: not a real path (absolute, no '..'), which an image read without links needs")
    folder = os.open(os.sep, _SEARCH | os.O_DIRECTORY)
    try:
        for depth, name in enumerate(parts[1:], start=1):
            mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                raise ImageError(f"{path}: {Path(*parts[: depth + 1])} is now a symbolic link, not there when the "
                                 "path was resolved: not followed")
            if depth == len(parts) - 1:
                _check_regular(mode, path)
                return os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=folder)
            inner = os.open(name, _SEARCH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
            os.close(folder)
            folder = inner
    finally:
        os.close(folder)
    raise ImageError(f"{path}: names a folder, not an image file")


def _check_regular(mode: int, path: Path) -> None:
    if not stat.S_ISREG(mode):
        raise ImageError(f"{path}: not a regular file ({file_kind(mode)}); an image must be one")


def image_patches(image, settings: ImageSettings) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(patches [P, C*Tp*p*p] fp32, grid (t, h, w) in patches) of one PIL image."""
    from PIL import Image

    height, width = target_size(image.height, image.width, settings)
    resized = image.resize((width, height), resample=Image.Resampling(settings.resample))
    # Rescaled in float64, then float32, as transformers' rescale.
    pixels = (np.asarray(resized, dtype=np.float64) * settings.rescale_factor).astype(np.float32)  # [H, W, C]
    mean, std = np.asarray(settings.image_mean, dtype=np.float32), np.asarray(settings.image_std, dtype=np.float32)
    pixels = (pixels - mean) / std
    pixels = pixels.transpose(2, 0, 1)  # [C, H, W]
    p, m, tp = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    channels = pixels.shape[0]
    blocks = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], tp, p, p))
    patches = np.ascontiguousarray(blocks).reshape(grid_h * grid_w, channels * tp * p * p)
    return torch.from_numpy(patches.copy()), (1, grid_h, grid_w)


def read_image_patches(path: Path, settings: ImageSettings, links: bool = True) -> tuple[torch.Tensor,
                                                                                        tuple[int, int, int]]:
    """load_image then image_patches of the file at `path`; ImageError naming the file (a size image_patches cannot
    cut, as an aspect ratio above 200, included)."""
    image = load_image(path, links=links)
    try:
        return image_patches(image, settings)
    except ImageError as err:  # its line names the rule, not the file
        raise ImageError(f"{path}: {err}") from None


def image_token_count(grid: tuple[int, int, int], settings: ImageSettings) -> int:
    """Language-model tokens one image becomes: its patches folded merge_size x merge_size at a time."""
    t, h, w = grid
    return t * h * w // settings.merge_size**2
