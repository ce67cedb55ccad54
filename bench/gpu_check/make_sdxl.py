"""A random-weight SDXL checkpoint (fp16, the original/LDM key layout) that sd-scripts' loader takes with "All keys
matched", built on the GPU (or, for the rehearsal, the CPU): ../shared/rig/make_random_sdxl.py's method, with the
initialisation on `--device`.

Run by the TRAINER's interpreter (torch, diffusers, transformers, accelerate, sd-scripts' `library`), never by the
worker's: `cd <sd-scripts> && <trainer python> <this file> --device cuda OUT.safetensors`.

The same models as sd-scripts' own save path (sdxl_model_util.save_stable_diffusion_checkpoint): the sdxl_original
U-Net, CLIPTextModel (TE1), CLIPTextModelWithProjection (TE2), diffusers' AutoencoderKL, and sd-scripts' key
conversions. The safetensors header is computed first from meta tensors; then each tensor is written straight to
its offset: the U-Net one leaf module at a time (reset_parameters() is its constructor's init), the text encoders
and the VAE whole, initialised in fp32 on the device, then cast. 6.94 GB, 2514 tensors.
"""
import argparse
import json
import os
import sys
import time

# Python put this file's folder first on the path: none of the check's modules may stand in for a package the
# trainer imports (a `tokenizers.py` here once hid transformers' tokenizers). sd-scripts' `library` comes from the cwd.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.getcwd()] + [p for p in sys.path if os.path.abspath(p or ".") != _here]
import torch  # noqa: E402
from accelerate import init_empty_weights  # noqa: E402
from diffusers import AutoencoderKL  # noqa: E402
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection  # noqa: E402

from library import model_util, sdxl_model_util, sdxl_original_unet  # noqa: E402

LOGIT_SCALE = torch.tensor(4.6052)


def te_cfg(hidden, inter, layers, heads, act, proj):
    return CLIPTextConfig(vocab_size=49408, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=heads, max_position_embeddings=77, hidden_act=act, layer_norm_eps=1e-05,
                          dropout=0.0, attention_dropout=0.0, initializer_range=0.02, initializer_factor=1.0,
                          pad_token_id=1, bos_token_id=0, eos_token_id=2, model_type="clip_text_model",
                          projection_dim=proj)


# the exact configs load_models_from_sdxl_checkpoint builds
TE1_CFG = te_cfg(768, 3072, 12, 12, "quick_gelu", 768)
TE2_CFG = te_cfg(1280, 5120, 32, 20, "gelu", 1280)
VAE_CFG = model_util.create_vae_diffusers_config()


def te1_sd(m):
    return {"conditioner.embedders.0.transformer." + k: v for k, v in m.state_dict().items()}


def te2_sd(m):
    sd = sdxl_model_util.convert_text_encoder_2_state_dict_to_sdxl(m.state_dict(), LOGIT_SCALE.to(m.device))
    return {"conditioner.embedders.1.model." + k: v for k, v in sd.items()}


def vae_sd(m):
    return {"first_stage_model." + k: v for k, v in model_util.convert_vae_state_dict(m.state_dict()).items()}


def layout():
    """Every key and shape, from meta tensors; the U-Net (still on meta) for pass 2."""
    with init_empty_weights():
        unet = sdxl_original_unet.SdxlUNet2DConditionModel()
        te1, te2 = CLIPTextModel._from_config(TE1_CFG), CLIPTextModelWithProjection(TE2_CFG)
        vae = AutoencoderKL(**VAE_CFG)
    shapes = {"model.diffusion_model." + k: tuple(v.shape) for k, v in unet.state_dict().items()}
    for fn, m in ((te1_sd, te1), (te2_sd, te2), (vae_sd, vae)):
        shapes.update({k: tuple(v.shape) for k, v in fn(m).items()})
    header, offset = {}, 0
    for key in sorted(shapes):
        n = 2
        for d in shapes[key]:
            n *= d
        header[key] = {"dtype": "F16", "shape": list(shapes[key]), "data_offsets": [offset, offset + n]}
        offset += n
    return unet, header, offset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("out")
    args = parser.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    device = torch.device(args.device)
    unet, header, size = layout()
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    data_start = 8 + len(hjson)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".part"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.pwrite(fd, len(hjson).to_bytes(8, "little") + hjson, 0)
    os.ftruncate(fd, data_start + size)
    written = set()

    def put(key, tensor):
        meta = header[key]
        assert list(tensor.shape) == meta["shape"], (key, tensor.shape, meta["shape"])
        buf = tensor.detach().to(torch.float16).contiguous().cpu().numpy().tobytes()
        assert len(buf) == meta["data_offsets"][1] - meta["data_offsets"][0], key
        os.pwrite(fd, buf, data_start + meta["data_offsets"][0])
        written.add(key)

    print(f"{len(header)} tensors, {size / 1e9:.2f} GB of data, on {device}", flush=True)
    n_params = 0
    for name, mod in unet.named_modules():
        own = list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
        if not own:
            continue
        assert hasattr(mod, "reset_parameters"), f"{name}: {type(mod).__name__} has no reset_parameters"
        mod.to_empty(device=device, recurse=False)
        mod.reset_parameters()
        for pname, p in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            put("model.diffusion_model." + (f"{name}.{pname}" if name else pname), p)
            n_params += p.numel()
        mod.to("meta")
    print(f"U-Net: {n_params / 1e6:.1f} M params written, {time.time() - t0:.1f} s", flush=True)
    for label, build, fn in (("text encoder 1", lambda: CLIPTextModel._from_config(TE1_CFG), te1_sd),
                             ("text encoder 2", lambda: CLIPTextModelWithProjection(TE2_CFG), te2_sd),
                             ("VAE", lambda: AutoencoderKL(**VAE_CFG), vae_sd)):
        with device:
            m = build()
        for k, v in fn(m).items():
            put(k, v)
        print(f"{label}: {sum(p.numel() for p in m.parameters()) / 1e6:.1f} M params written on "
              f"{next(m.parameters()).device}, {time.time() - t0:.1f} s", flush=True)
        del m
    missing = set(header) - written
    assert not missing, sorted(missing)[:10]
    os.fsync(fd)
    os.close(fd)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(header)} keys, {os.path.getsize(args.out) / 1e9:.2f} GB, {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
