"""The examples and the GPU check are correct Python and shell, though torch, transformers'
models, Accelerate and Lightning are not installed here to run them."""

import importlib
import importlib.util
import pathlib
import py_compile
import subprocess

import pytest

import stoker

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLES = sorted((HERE.parent / "examples").glob("*.py"))
REPO = HERE.parents[2]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_byte_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / (path.name + "c")), doraise=True)


def test_the_examples_cover_the_frameworks():
    assert {p.name for p in EXAMPLES} >= {"train.py", "checkpoint_loop.py", "hf_trainer.py", "accelerate_loop.py",
                                          "lightning_module.py"}


def test_gpu_check_script_is_valid_bash():
    out = subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu-check.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_gpu_check_imports_without_torch_and_parses_its_arguments():
    gpu_check = importlib.import_module("stoker.gpu_check")
    args = gpu_check.parse_args(["--socket", "/tmp/x.sock", "--batches", "5", "--expect-pinned"])
    assert (args.socket, args.batches, args.expect_pinned) == ("/tmp/x.sock", 5, True)


def test_stoker_torch_imports_without_torch():
    loader_module = importlib.import_module("stoker.torch")
    assert issubclass(loader_module.Loader, stoker.Stream)
    if importlib.util.find_spec("torch") is None:
        with pytest.raises(stoker.StokerError, match="needs PyTorch"):
            loader_module.resolve_device()
    else:
        assert loader_module.resolve_device("cpu").type == "cpu"
