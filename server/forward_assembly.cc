#include "server/forward_assembly.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "proto/codec.h"

namespace flce {
namespace {

// The tensor of `request` a streamed chunk fills, or null if the request
// does not carry that field.
v1::Tensor* ForwardField(v1::ForwardRequest& r, v1::TensorField field) {
  switch (field) {
    case v1::TENSOR_FIELD_HIDDEN:
      return r.has_hidden() ? r.mutable_hidden() : nullptr;
    case v1::TENSOR_FIELD_WEIGHT:
      return r.has_weight() ? r.mutable_weight() : nullptr;
    case v1::TENSOR_FIELD_BIAS:
      return r.has_bias() ? r.mutable_bias() : nullptr;
    case v1::TENSOR_FIELD_TARGET:
      return r.has_target() ? r.mutable_target() : nullptr;
    case v1::TENSOR_FIELD_CLASS_WEIGHT:
      return r.options().has_class_weight() ? r.mutable_options()->mutable_class_weight() : nullptr;
    default:
      return nullptr;
  }
}

const char* FieldName(v1::TensorField field) {
  switch (field) {
    case v1::TENSOR_FIELD_HIDDEN:
      return "hidden";
    case v1::TENSOR_FIELD_WEIGHT:
      return "weight";
    case v1::TENSOR_FIELD_BIAS:
      return "bias";
    case v1::TENSOR_FIELD_TARGET:
      return "target";
    case v1::TENSOR_FIELD_CLASS_WEIGHT:
      return "options.class_weight";
    default:
      return "chunk.field";
  }
}

}  // namespace

absl::StatusOr<int64_t> ForwardAssembly::Take(v1::ForwardRequestChunk* message) {
  if (!started_) {
    if (!message->has_request()) {
      return absl::InvalidArgumentError("request: required on the first message");
    }
    request_ = std::move(*message->mutable_request());
    started_ = true;
    // Size every announced tensor up front (bounded by the limits).
    int64_t total = 0;
    for (int f = v1::TENSOR_FIELD_HIDDEN; f <= v1::TENSOR_FIELD_CLASS_WEIGHT; ++f) {
      v1::Tensor* t = ForwardField(request_, static_cast<v1::TensorField>(f));
      if (t == nullptr || !t->data().empty() || t->has_shm()) continue;
      FLCE_ASSIGN_OR_RETURN(const int64_t bytes,
                            TensorBytes(*t, FieldName(static_cast<v1::TensorField>(f))));
      total += bytes;
      if (total > max_bytes_) {
        return absl::ResourceExhaustedError(
            absl::StrCat("ForwardStream: the request's tensors need ", total,
                         " bytes, over the limit of ", max_bytes_));
      }
      expected_[f] = bytes;
    }
    return total;
  }
  if (message->has_request()) {
    return absl::InvalidArgumentError("request: only the first message carries one");
  }
  const v1::TensorField field = message->chunk().field();
  v1::Tensor* t = ForwardField(request_, field);
  auto expected = expected_.find(field);
  if (t == nullptr || expected == expected_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk.field: ",
        v1::TensorField_Name(field).empty() ? std::to_string(field) : v1::TensorField_Name(field),
        " is not a tensor the request announced without data"));
  }
  const std::string& data = message->chunk().data();
  std::string* into = t->mutable_data();
  if (static_cast<int64_t>(into->size() + data.size()) > expected->second) {
    return absl::InvalidArgumentError(
        absl::StrCat(FieldName(field), ": more bytes than its ", expected->second));
  }
  // The whole tensor is reserved with its first bytes (untouched memory
  // costs nothing until written), so appending never reallocates.
  if (into->capacity() < static_cast<size_t>(expected->second)) {
    into->reserve(static_cast<size_t>(expected->second));
  }
  into->append(data);
  return 0;
}

absl::Status ForwardAssembly::End() {
  if (!started_) return absl::InvalidArgumentError("request: the stream carried no message");
  for (int f = v1::TENSOR_FIELD_HIDDEN; f <= v1::TENSOR_FIELD_CLASS_WEIGHT; ++f) {
    auto expected = expected_.find(f);
    if (expected == expected_.end()) continue;
    const v1::Tensor* t = ForwardField(request_, static_cast<v1::TensorField>(f));
    if (static_cast<int64_t>(t->data().size()) != expected->second) {
      return absl::InvalidArgumentError(absl::StrCat(FieldName(static_cast<v1::TensorField>(f)),
                                                     ": received ", t->data().size(), " of ",
                                                     expected->second, " bytes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace flce
