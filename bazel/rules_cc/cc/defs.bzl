"""Offline stand-in for @rules_cc//cc:defs.bzl: forwards to Bazel's native C++ rules.

Bazel 4.2 (Debian's bazel-bootstrap) loads @rules_cc from its own cpp
toolchain BUILD files and would download it; these are the only symbols it
needs, and in Bazel 4 they are native rules anyway.
"""

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)
