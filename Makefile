# Two commands on a fresh machine with Python >= 3.10 and make: `make demo`, `make test`
# (`make docs` builds the documentation site into site/).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The lowest supported Keras (keras_strategies/_version.py): `make test` also runs the JAX suite on it.
KERAS_MIN_VENV := .venv-keras-min
KERAS_MIN_PY := $(KERAS_MIN_VENV)/bin/python
KERAS_MIN_STAMP := $(KERAS_MIN_VENV)/.installed
# The next Keras, a pinned development build (requirements-keras-next.txt): `make test-keras-next`.
KERAS_NEXT_VENV := .venv-keras-next
KERAS_NEXT_PY := $(KERAS_NEXT_VENV)/bin/python
KERAS_NEXT_STAMP := $(KERAS_NEXT_VENV)/.installed

.PHONY: demo test test-gpu test-keras-min test-keras-next soak docs install clean

install: $(STAMP)

# The Keras libraries of requirements-libraries.txt, keras-hub without its dependencies (see there).
define install_libraries
	$(1) -m pip install --quiet -r requirements-libraries.txt
	$(1) -m pip install --quiet --no-deps $$(sed -n 's/^# no-deps: //p' requirements-libraries.txt)
endef

$(STAMP): requirements-dev.txt requirements-docs.txt requirements-libraries.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(call install_libraries,$(PY))
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(KERAS_MIN_STAMP): requirements-keras-min.txt requirements-libraries.txt pyproject.toml
	test -x $(KERAS_MIN_PY) || $(PYTHON) -m venv $(KERAS_MIN_VENV)
	$(KERAS_MIN_PY) -m pip install --quiet --upgrade pip
	$(KERAS_MIN_PY) -m pip install --quiet -r requirements-keras-min.txt
	$(call install_libraries,$(KERAS_MIN_PY))
	$(KERAS_MIN_PY) -m pip install --quiet --no-deps -e .
	touch $(KERAS_MIN_STAMP)

# keras-nightly installs the `keras` package under another name: TensorFlow's and keras-tuner's
# dependency on `keras` brings a release beside it, which is removed, and the development build is
# laid down again.
$(KERAS_NEXT_STAMP): requirements-keras-next.txt requirements-libraries.txt pyproject.toml
	test -x $(KERAS_NEXT_PY) || $(PYTHON) -m venv $(KERAS_NEXT_VENV)
	$(KERAS_NEXT_PY) -m pip install --quiet --upgrade pip
	$(KERAS_NEXT_PY) -m pip install --quiet -r requirements-keras-next.txt
	$(call install_libraries,$(KERAS_NEXT_PY))
	$(KERAS_NEXT_PY) -m pip uninstall --quiet --yes keras keras-hub
	$(KERAS_NEXT_PY) -m pip install --quiet --no-deps --force-reinstall $$(sed -n 's/^# no-deps: //p' requirements-keras-next.txt)
	$(KERAS_NEXT_PY) -m pip install --quiet --no-deps --force-reinstall $$(grep '^keras-nightly==' requirements-keras-next.txt)
	$(KERAS_NEXT_PY) -m pip install --quiet --no-deps -e .
	touch $(KERAS_NEXT_STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# The documentation site (mkdocs.yml, docs/), strict: a broken link or API reference fails.
# mkdocstrings reads keras_strategies; JAX is the quickest backend to import.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 KERAS_BACKEND=jax $(PY) -m mkdocs build --strict --quiet --site-dir site

# The docs build first (it takes seconds); then the three backends on the newest supported
# Keras, and JAX on the lowest, side by side.
test: docs $(KERAS_MIN_STAMP)
	KS_TEST_KERAS_MIN_PYTHON=$(CURDIR)/$(KERAS_MIN_PY) $(PY) scripts/test_all_backends.py

# The JAX suite on the lowest supported Keras alone.
test-keras-min: $(KERAS_MIN_STAMP)
	KS_TEST_BACKENDS=jax-keras-min KS_TEST_KERAS_MIN_PYTHON=$(CURDIR)/$(KERAS_MIN_PY) $(KERAS_MIN_PY) scripts/test_all_backends.py

# The whole suite, every backend, on the next Keras (a pinned development build).
test-keras-next: $(KERAS_NEXT_STAMP)
	$(KERAS_NEXT_PY) scripts/test_all_backends.py

# The soak test (random workers killed under the launcher's --max-restarts), five new kill
# plans on every backend; `make test` runs one, on PyTorch (KS_SOAK_BACKENDS).
soak: $(STAMP)
	for backend in tensorflow jax torch; do for run in 1 2 3 4 5; do \
		KS_SOAK_BACKENDS=$$backend KERAS_BACKEND=$$backend $(PY) -m pytest -q -k random_kills tests/multi_worker/test_multi_worker_soak.py || exit 1; \
	done; done

# Only the tests marked `gpu` (they skip with fewer than 2 GPUs; `make test` runs them too). One
# backend at a time, each taking GPU memory only as it needs it: side by side they would compete for it.
test-gpu: $(STAMP)
	KS_TEST_JOBS=1 TF_FORCE_GPU_ALLOW_GROWTH=true XLA_PYTHON_CLIENT_PREALLOCATE=false \
		$(PY) scripts/test_all_backends.py -m gpu

clean:
	rm -rf $(VENV) $(KERAS_MIN_VENV) $(KERAS_NEXT_VENV) site
