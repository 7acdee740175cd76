"""Offline stand-in for @rules_java//java:defs.bzl: forwards to Bazel's native Java rules.

Bazel 4.2 parses @bazel_tools//tools/jdk (which loads this) for every build,
even a C++-only one; these are the symbols it loads.
"""

def java_binary(**kwargs):
    native.java_binary(**kwargs)

def java_import(**kwargs):
    native.java_import(**kwargs)

def java_runtime(**kwargs):
    native.java_runtime(**kwargs)

def java_toolchain(**kwargs):
    native.java_toolchain(**kwargs)
