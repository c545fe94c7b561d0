if __name__ != "mmtrain.data_pipelines":  # the checkout's folder under its own name: a second copy
    raise ImportError(f"import mmtrain.data_pipelines, not {__name__}: the folder is installed under that "
                      "name (pip install -e . or make install)")
