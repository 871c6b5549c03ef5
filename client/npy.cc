#include "client/npy.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace flce {
namespace {

constexpr char kMagic[] = "\x93NUMPY";

absl::Status Bad(const std::string& path, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", why));
}

// The value after `'key':` in the header dict, up to the next top-level comma.
std::string HeaderValue(const std::string& header, const std::string& key) {
  const std::string needle = "'" + key + "':";
  size_t pos = header.find(needle);
  if (pos == std::string::npos) return "";
  pos += needle.size();
  int depth = 0;
  size_t end = pos;
  for (; end < header.size(); ++end) {
    const char c = header[end];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if ((c == ',' && depth == 0) || c == '}') break;
  }
  return std::string(absl::StripAsciiWhitespace(header.substr(pos, end - pos)));
}

}  // namespace

absl::StatusOr<HostTensor> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  char magic[8];
  if (!in.read(magic, 8) || std::memcmp(magic, kMagic, 6) != 0) {
    return Bad(path, "not a .npy file");
  }
  const int major = static_cast<unsigned char>(magic[6]);
  uint32_t header_len = 0;
  if (major == 1) {
    unsigned char len[2];
    if (!in.read(reinterpret_cast<char*>(len), 2)) return Bad(path, "truncated header");
    header_len = len[0] | (len[1] << 8);
  } else if (major == 2 || major == 3) {
    unsigned char len[4];
    if (!in.read(reinterpret_cast<char*>(len), 4)) return Bad(path, "truncated header");
    header_len = len[0] | (len[1] << 8) | (len[2] << 16) | (uint32_t{len[3]} << 24);
  } else {
    return Bad(path, absl::StrCat("unsupported .npy version ", major));
  }
  if (header_len > (1u << 20)) return Bad(path, "header too long");
  std::string header(header_len, '\0');
  if (!in.read(&header[0], header_len)) return Bad(path, "truncated header");

  const std::string descr = HeaderValue(header, "descr");
  HostTensor out;
  if (descr == "'<f4'") {
    out.dtype = DType::kFloat32;
  } else if (descr == "'<f2'") {
    out.dtype = DType::kFloat16;
  } else if (descr == "'<i4'") {
    out.dtype = DType::kInt32;
  } else if (descr == "'<i8'") {
    out.dtype = DType::kInt64;
  } else {
    return Bad(path, absl::StrCat("dtype ", descr,
                                  " not supported; expected <f4, <f2, <i4 or <i8"));
  }
  if (HeaderValue(header, "fortran_order") != "False") {
    return Bad(path, "Fortran-ordered arrays are not supported; save a C-ordered copy");
  }
  std::string shape = HeaderValue(header, "shape");
  if (shape.size() < 2 || shape.front() != '(' || shape.back() != ')') {
    return Bad(path, absl::StrCat("malformed shape ", shape));
  }
  for (absl::string_view part :
       absl::StrSplit(shape.substr(1, shape.size() - 2), ',', absl::SkipWhitespace())) {
    int64_t dim;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &dim) || dim < 0) {
      return Bad(path, absl::StrCat("malformed shape ", shape));
    }
    out.shape.push_back(dim);
  }
  out.data.resize(static_cast<size_t>(out.num_elements()) * DTypeSize(out.dtype));
  if (!in.read(&out.data[0], static_cast<std::streamsize>(out.data.size()))) {
    return Bad(path, absl::StrCat("truncated data: expected ", out.data.size(), " bytes"));
  }
  return out;
}

absl::Status WriteNpy(const std::string& path, const TensorView& tensor) {
  std::string descr;
  std::vector<float> widened;
  const void* data = tensor.data;
  DType dtype = tensor.dtype;
  switch (tensor.dtype) {
    case DType::kFloat32: descr = "<f4"; break;
    case DType::kFloat16: descr = "<f2"; break;
    case DType::kInt32: descr = "<i4"; break;
    case DType::kInt64: descr = "<i8"; break;
    case DType::kBFloat16:
      descr = "<f4";
      widened = TensorToFloats(tensor);
      data = widened.data();
      dtype = DType::kFloat32;
      break;
  }
  std::string shape = "(";
  for (int64_t d : tensor.shape) absl::StrAppend(&shape, d, ",");
  if (tensor.shape.size() > 1) shape.pop_back();
  shape += ")";
  std::string header = absl::StrCat("{'descr': '", descr,
                                    "', 'fortran_order': False, 'shape': ", shape, ", }");
  // Pad so the data starts at a multiple of 64 bytes, ending with '\n'.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write"));
  out.write(kMagic, 6);
  const char version[2] = {1, 0};
  out.write(version, 2);
  const unsigned char len[2] = {static_cast<unsigned char>(header.size() & 0xff),
                                static_cast<unsigned char>(header.size() >> 8)};
  out.write(reinterpret_cast<const char*>(len), 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(data),
            static_cast<std::streamsize>(tensor.num_elements() * DTypeSize(dtype)));
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace flce
