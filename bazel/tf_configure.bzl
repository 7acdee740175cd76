"""Repository rule exposing the pip-installed TensorFlow to Bazel.

Runs the Python in $PYTHON_BIN_PATH (default: <workspace>/.venv/bin/python),
asks tf.sysconfig where the headers and libtensorflow_framework live, and
symlinks them into @local_tensorflow. Nothing is downloaded.
"""

def _tf_local_repository_impl(ctx):
    workspace = ctx.path(Label("//:WORKSPACE")).dirname
    python = ctx.os.environ.get("PYTHON_BIN_PATH", "%s/.venv/bin/python" % workspace)
    script = "import tensorflow as tf, sys; sys.stdout.write(tf.sysconfig.get_include() + '\\n' + tf.sysconfig.get_lib())"
    result = ctx.execute([python, "-c", script], environment = {"TF_CPP_MIN_LOG_LEVEL": "3"})
    if result.return_code != 0:
        fail("cannot import tensorflow with %s (set PYTHON_BIN_PATH):\n%s" % (python, result.stderr))
    include_dir, lib_dir = result.stdout.strip().split("\n")[-2:]
    ctx.symlink(include_dir, "include")
    ctx.symlink(lib_dir + "/libtensorflow_framework.so.2", "libtensorflow_framework.so.2")
    ctx.file("BUILD.bazel", """
cc_library(
    name = "tensorflow_framework",
    hdrs = glob(["include/**/*.h", "include/**/*.inc", "include/**/*.hpp", "include/**/*", ]),
    includes = ["include"],
    srcs = ["libtensorflow_framework.so.2"],
    defines = ["EIGEN_MAX_ALIGN_BYTES=64", "_GLIBCXX_USE_CXX11_ABI=1"],
    visibility = ["//visibility:public"],
)
""")

tf_local_repository = repository_rule(
    implementation = _tf_local_repository_impl,
    environ = ["PYTHON_BIN_PATH"],
    local = True,
)
