"""shardtrain_dependencies(): every external repository ShardTrain needs.

A consumer workspace calls it after `local_repository(name = "shardtrain", ...)`.
Each repository is declared only when the consumer has not declared one of the
same name first, so any of them can be replaced (remapped) by the consumer.
Nothing here downloads: Bazel's own rule sets come from Debian packages or are
generated locally, LibTorch and CUDA are found on the machine.
"""

load("//third_party:bazel_shims.bzl", "remote_coverage_tools_shim", "rules_cc_shim")
load("//third_party:libtorch.bzl", "libtorch_repository")
load("//third_party:cuda.bzl", "cuda_repository")
load("//third_party:system_libs.bzl", "system_library")

def _maybe(rule, name, **kwargs):
    if not native.existing_rule(name):
        rule(name = name, **kwargs)

def shardtrain_dependencies():
    """Declares the repositories ShardTrain's targets depend on."""
    _maybe(rules_cc_shim, "rules_cc")
    _maybe(native.local_repository, "rules_java", path = "/usr/share/bazel/rules/java")
    _maybe(native.local_repository, "platforms", path = "/usr/share/bazel/tools/platforms")
    _maybe(remote_coverage_tools_shim, "remote_coverage_tools")

    # LibTorch: LIBTORCH_HOME, else the pinned pip torch the bootstrap installed.
    _maybe(libtorch_repository, "libtorch")

    # CUDA toolkit and the NCCL the chosen LibTorch uses; a placeholder when absent.
    _maybe(cuda_repository, "local_cuda")

    # Debian's libraries, each behind a remappable repository name.
    _maybe(
        system_library,
        "com_google_absl",
        headers = ["absl"],
        libs = {
            "strings": ["absl_strings", "absl_strings_internal", "absl_int128", "absl_throw_delegate", "absl_raw_logging_internal", "absl_base", "absl_spinlock_wait", "absl_log_severity"],
            "str_format": ["absl_str_format_internal", "absl_strings", "absl_strings_internal", "absl_int128", "absl_throw_delegate", "absl_raw_logging_internal", "absl_base", "absl_spinlock_wait", "absl_log_severity"],
        },
    )
    _maybe(system_library, "com_github_google_glog", headers = ["glog"], libs = {"glog": ["glog"]})
    _maybe(system_library, "com_github_gflags_gflags", headers = ["gflags"], libs = {"gflags": ["gflags"]})
    _maybe(
        system_library,
        "com_google_googletest",
        headers = ["gtest", "gmock"],
        libs = {"gtest": ["gtest"], "gtest_main": ["gtest_main", "gtest"], "gmock": ["gmock", "gtest"]},
    )
    # Gloo's headers only (c10d's ProcessGroupGloo.hpp includes them; the Gloo
    # code itself is the copy inside libtorch_cpu, never linked twice).
    _maybe(system_library, "gloo_headers", headers = ["gloo"], libs = {"gloo": []})
    _maybe(system_library, "nlohmann_json", headers = ["nlohmann"], libs = {"json": []})
    # zlib (Debian zlib1g-dev): examples/fashion_mnist reads the gzipped IDX files.
    _maybe(system_library, "zlib", headers = ["zlib.h", "zconf.h"], libs = {"zlib": ["z"]})
    # Intel ISA-L (Debian libisal-dev): the CRC-32 of checkpoint archives
    # (trainer/checkpoint_io/zip_writer.cc), about 12 GB/s.
    _maybe(system_library, "isal", headers = ["isa-l", "isa-l.h"], libs = {"isal": ["isal"]})
    # SentencePiece (Debian libsentencepiece-dev): the Llama example's
    # tokenizer.model files and the tokenizer it trains (examples/llama/tokenizer.cc).
    _maybe(
        system_library,
        "sentencepiece",
        headers = ["sentencepiece_processor.h", "sentencepiece_trainer.h"],
        libs = {"sentencepiece": ["sentencepiece_train", "sentencepiece"]},
    )
    # PCRE2 (Debian libpcre2-dev) and ICU (Debian libicu-dev): the regular
    # expressions and Unicode normalization of byte-level BPE tokenizer.json
    # files (examples/llama/bpe_tokenizer.cc).
    _maybe(system_library, "pcre2", headers = ["pcre2.h"], libs = {"pcre2": ["pcre2-8"]})
    _maybe(system_library, "icu", headers = ["unicode"], libs = {"icu": ["icuuc"]})
    # OpenSSL's libcrypto (Debian libssl-dev): HMAC-SHA-256 of the rendezvous
    # store's values (comm/signed_store.cc). Debian keeps openssl/configuration.h
    # under the multiarch include directory: a second, headers-only repository.
    _maybe(system_library, "openssl", headers = ["openssl"], libs = {"crypto": ["crypto"]})
    _maybe(
        system_library,
        "openssl_arch",
        include_dir = "/usr/include/x86_64-linux-gnu",
        headers = ["openssl"],
        libs = {"headers": []},
    )
