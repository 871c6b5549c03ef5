"""C++ code generation from .proto files with the system protoc.

`flce_cc_proto_library(name, src, deps)` runs /usr/bin/protoc with the
grpc_cpp_plugin over one .proto file and wraps the generated sources in a
cc_library that links the system protobuf and gRPC libraries.
"""

def flce_cc_proto_library(name, src, deps = [], visibility = None):
    stem = src[:-len(".proto")]
    pkg = native.package_name()
    outs = [stem + ext for ext in [".pb.h", ".pb.cc", ".grpc.pb.h", ".grpc.pb.cc"]]
    native.genrule(
        name = name + "_codegen",
        srcs = [src],
        outs = outs,
        cmd = " ".join([
            "/usr/bin/protoc",
            "--proto_path=.",
            "--cpp_out=$(GENDIR)",
            "--grpc_out=$(GENDIR)",
            "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin",
            "%s/%s" % (pkg, src),
        ]),
    )
    native.cc_library(
        name = name,
        srcs = [stem + ".pb.cc", stem + ".grpc.pb.cc"],
        hdrs = [stem + ".pb.h", stem + ".grpc.pb.h"],
        deps = deps + ["@grpc//:grpcpp", "@protobuf//:protobuf"],
        visibility = visibility,
    )
