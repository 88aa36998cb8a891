PYTHON ?= python3
BACKEND ?=

.PHONY: install test test-gpu mutants lint check check-full bench plot info clean

install:            ## editable install with the test tools
	$(PYTHON) -m pip install -e '.[dev]'

test:               ## the CPU suite (GPU tests skip without a GPU)
	$(PYTHON) -m pytest -q

mutants:            ## planted kernel bugs, each must fail its tests (emulator; ~1-2 min)
	$(PYTHON) tests/mutants.py

test-gpu:           ## the CUDA test modules (need a GPU and CuPy)
	$(PYTHON) -m pytest -q tests/test_cuda_gpu.py tests/test_cuda_graphs.py -rs

plot:               ## PNG of a saved bench JSON: make plot JSON=run.json PNG=run.png
	paged-decode plot $(JSON) $(PNG)

lint:
	ruff check paged_decode tests
	mypy paged_decode

check:              ## quick correctness matrix on the default backend
	paged-decode check $(if $(BACKEND),--backend $(BACKEND))

check-full:
	paged-decode check --full $(if $(BACKEND),--backend $(BACKEND))

bench:              ## gather vs v1 vs v2 sweep on the default backend
	paged-decode bench $(if $(BACKEND),--backend $(BACKEND))

info:
	paged-decode info

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache
