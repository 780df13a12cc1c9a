# plan3d: `make demo` runs the main job on the bundled presets, `make test` runs the test suite.
# Both create .venv on first use. torch is pinned to the CPU build on this machine's disk before
# the project's extras are installed, so the extras' range (torch>=2.4) is already met.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: install demo test bench clean

$(VENV)/.installed: pyproject.toml requirements-consumers.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	# the dev extras and the launch files' consumers in one resolve: torchtitan's `datasets` caps
	# huggingface-hub below 2, so transformers must be a release that accepts that hub (a second
	# install would downgrade the hub under an already installed transformers)
	# (constraints.txt: the versions of the last green CI run, so a new release cannot move the tests)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]" -r requirements-consumers.txt
	# DeepSpeed builds against the torch installed above
	$(PY) -m pip install --quiet -c constraints.txt --no-build-isolation "deepspeed==0.19.8"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/plan3d search --model llama3-70b --hardware h100-sxm-80gb --gpus 64 --global-batch 128 \
		--seq-len 8192 --top 3
	$(VENV)/bin/plan3d estimate --model gpt3-175b --hardware a100-80gb --gpus 64 --global-batch 64 \
		--seq-len 2048 --tp 8 --pp 8 --vpp 3 --sequence-parallel --recompute selective

test: install
	$(PY) -m pytest -q

bench: install
	for f in benchmarks/*.py; do $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
