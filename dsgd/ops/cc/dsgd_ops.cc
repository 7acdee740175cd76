// TensorFlow ops that move gradient partitions between tensors and memory that
// Python hands them (a shared-memory buffer or a Ray object-store object):
//   DsgdPack          gradient pieces -> one flat partition tensor (one pass; float32
//                     -> bfloat16 / half while copying, for wire compression)
//   DsgdAliasTensor   registered buffer -> tensor aliasing it
//   DsgdUnpack        flat partition tensors -> per-variable gradients (aliasing
//                     the partition whenever a variable lies in one aligned piece
//                     of the same dtype; bfloat16 / half -> float32 while copying)
//   DsgdDataAddress   a tensor's data address (for tests and debugging)
#include <cstdint>
#include <cstring>
#include <vector>

#include "dsgd/ops/cc/wire_kernels.h"
#include "dsgd/ops/cc/buffer_registry.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace {

constexpr char kTypes[] =
    "T: {half, bfloat16, float, double, int8, uint8, int16, int32, int64}";
// The dtype a partition travels in: T itself, or a 16-bit form of a float32 T.
constexpr char kWireTypes[] =
    "W: {half, bfloat16, float, double, int8, uint8, int16, int32, int64}";
constexpr uintptr_t kAlignBytes = 64;

// Whether a partition of `from` elements can be copied into `to` elements:
// the same dtype, or float32 and one of its 16-bit wire forms either way.
bool Convertible(DataType from, DataType to) {
  if (from == to) return true;
  const bool narrow = to == DT_BFLOAT16 || to == DT_HALF;
  const bool widen = from == DT_BFLOAT16 || from == DT_HALF;
  return (from == DT_FLOAT && narrow) || (to == DT_FLOAT && widen);
}

// Copies `n` elements from `src` (dtype `from`) to `dst` (dtype `to`),
// converting on the way; the pair must be Convertible. half uses Eigen's
// conversion (nearest, ties to even; beyond 65504 is inf), as numpy does.
void CopyElements(DataType from, DataType to, const char* src, char* dst, int64_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * DataTypeSize(from));
    return;
  }
  if (from == DT_FLOAT) {
    const float* in = reinterpret_cast<const float*>(src);
    if (to == DT_BFLOAT16) {
      dsgd::FloatToBfloat16(in, reinterpret_cast<uint16_t*>(dst), n);
    } else {
      Eigen::half* out = reinterpret_cast<Eigen::half*>(dst);
      for (int64_t i = 0; i < n; ++i) out[i] = Eigen::half(in[i]);
    }
    return;
  }
  float* out = reinterpret_cast<float*>(dst);
  if (from == DT_BFLOAT16) {
    dsgd::Bfloat16ToFloat(reinterpret_cast<const uint16_t*>(src), out, n);
  } else {
    const Eigen::half* in = reinterpret_cast<const Eigen::half*>(src);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
  }
}

absl::Status CheckConvertible(DataType from, DataType to) {
  if (Convertible(from, to)) return absl::OkStatus();
  return errors::InvalidArgument("cannot convert ", DataTypeString(from), " to ",
                                 DataTypeString(to),
                                 ": a partition travels as its gradients' dtype, or "
                                 "float32 as bfloat16 or half");
}

bool IsAligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kAlignBytes == 0;
}

// A tensor's bytes, through the public Tensor::tensor_data().
const char* Data(const Tensor& t) { return t.tensor_data().data(); }
char* MutableData(Tensor* t) { return const_cast<char*>(t->tensor_data().data()); }

// Memory owned by Python (shared memory or an object-store object); the last
// tensor using it releases the registry handle so Python can drop its array.
class AliasedBuffer : public TensorBuffer {
 public:
  AliasedBuffer(int64_t handle, void* data, size_t nbytes)
      : TensorBuffer(data), handle_(handle), nbytes_(nbytes) {}
  ~AliasedBuffer() override { dsgd::ReleaseBuffer(handle_); }

  size_t size() const override { return nbytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(AllocationDescription* proto) const override {
    proto->set_requested_bytes(nbytes_);
    proto->set_allocator_name("dsgd_aliased_buffer");
  }
  // Not ours to write: stops TensorFlow from forwarding it to in-place ops.
  bool OwnsMemory() const override { return false; }

 private:
  const int64_t handle_;
  const size_t nbytes_;
};

// A byte range of another buffer, keeping that buffer alive.
// A view of part of another tensor's memory. Holding a Tensor keeps that
// memory alive, with no need for TensorFlow's private DMAHelper; like
// AliasedBuffer it does not own the memory, so TensorFlow never forwards it to
// an op that would write in place (Tensor::Slice's view would allow that).
class AliasBuffer : public TensorBuffer {
 public:
  AliasBuffer(const Tensor& owner, void* data, size_t nbytes)
      : TensorBuffer(data), owner_(owner), nbytes_(nbytes) {}

  size_t size() const override { return nbytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(AllocationDescription* proto) const override {
    proto->set_requested_bytes(nbytes_);
    proto->set_allocator_name("dsgd_alias");
  }
  bool OwnsMemory() const override { return false; }

 private:
  const Tensor owner_;
  const size_t nbytes_;
};

// One contiguous run of elements copied between a variable and a partition.
struct Piece {
  int64_t output;  // unpack: output index; pack: unused
  int64_t input;
  int64_t var_offset;
  int64_t partition_offset;
  int64_t size;
};

absl::Status ReadPieces(OpKernelConstruction* ctx, bool with_output,
                        std::vector<Piece>* pieces) {
  std::vector<int64_t> out, in, var_off, partition_off, size;
  if (with_output) TF_RETURN_IF_ERROR(ctx->GetAttr("piece_output", &out));
  TF_RETURN_IF_ERROR(ctx->GetAttr("piece_input", &in));
  TF_RETURN_IF_ERROR(ctx->GetAttr("piece_var_offset", &var_off));
  TF_RETURN_IF_ERROR(ctx->GetAttr("piece_partition_offset", &partition_off));
  TF_RETURN_IF_ERROR(ctx->GetAttr("piece_size", &size));
  size_t n = in.size();
  if (var_off.size() != n || partition_off.size() != n || size.size() != n ||
      (with_output && out.size() != n)) {
    return errors::InvalidArgument("piece_* attrs must have equal lengths");
  }
  for (size_t i = 0; i < n; ++i) {
    if (var_off[i] < 0 || partition_off[i] < 0 || size[i] < 0) {
      return errors::InvalidArgument("piece ", i, " has a negative offset or size");
    }
    pieces->push_back({with_output ? out[i] : 0, in[i], var_off[i], partition_off[i], size[i]});
  }
  return absl::OkStatus();
}

absl::Status CheckRange(const char* what, int64_t index, int64_t offset,
                        int64_t size, int64_t limit) {
  if (offset + size > limit) {
    return errors::InvalidArgument(what, " ", index, ": piece [", offset, ", ",
                                   offset + size, ") exceeds its ", limit,
                                   " elements");
  }
  return absl::OkStatus();
}

REGISTER_OP("DsgdPack")
    .Input("grads: N * T")
    .Output("partition: W")
    .Attr(kTypes)
    .Attr(kWireTypes)
    .Attr("N: int >= 1")
    .Attr("partition_size: int >= 0")
    .Attr("piece_input: list(int)")
    .Attr("piece_var_offset: list(int)")
    .Attr("piece_partition_offset: list(int)")
    .Attr("piece_size: list(int)")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t size;
      TF_RETURN_IF_ERROR(c->GetAttr("partition_size", &size));
      c->set_output(0, c->Vector(size));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Copies pieces of the flattened `grads` into one flat partition in a single pass.
Piece i copies `piece_size[i]` elements of `grads[piece_input[i]]` starting at
`piece_var_offset[i]` to `partition[piece_partition_offset[i]:]`. Pieces must be in
increasing, non-overlapping partition order; the gaps between them are zeroed.
`W` is `T`, or bfloat16 or half for a float32 `T`: then each element is
rounded (to nearest, ties to even) while it is copied.
)doc");

class PackOp : public OpKernel {
 public:
  explicit PackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int num_inputs;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &num_inputs));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("partition_size", &partition_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &grad_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("W", &wire_dtype_));
    OP_REQUIRES_OK(ctx, CheckConvertible(grad_dtype_, wire_dtype_));
    OP_REQUIRES_OK(ctx, ReadPieces(ctx, false, &pieces_));
    int64_t end = 0;
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const Piece& p = pieces_[i];
      OP_REQUIRES(ctx, p.input >= 0 && p.input < num_inputs,
                  errors::InvalidArgument("piece ", i, " names input ", p.input,
                                          " but there are ", num_inputs));
      OP_REQUIRES(ctx, p.partition_offset >= end,
                  errors::InvalidArgument("pieces must be sorted and disjoint"));
      end = p.partition_offset + p.size;
    }
    OP_REQUIRES_OK(ctx, CheckRange("partition", 0, 0, end, partition_size_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList grads;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    for (const Piece& p : pieces_) {
      OP_REQUIRES_OK(ctx, CheckRange("grads", p.input, p.var_offset, p.size,
                                     grads[p.input].NumElements()));
    }
    Tensor* partition = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({partition_size_}), &partition));
    const size_t item = DataTypeSize(wire_dtype_);
    const size_t grad_item = DataTypeSize(grad_dtype_);
    char* out = MutableData(partition);
    int64_t filled = 0;
    for (const Piece& p : pieces_) {
      std::memset(out + filled * item, 0, (p.partition_offset - filled) * item);
      const char* in = Data(grads[p.input]);
      CopyElements(grad_dtype_, wire_dtype_, in + p.var_offset * grad_item,
                   out + p.partition_offset * item, p.size);
      filled = p.partition_offset + p.size;
    }
    std::memset(out + filled * item, 0, (partition_size_ - filled) * item);
  }

 private:
  int64_t partition_size_;
  DataType grad_dtype_;
  DataType wire_dtype_;
  std::vector<Piece> pieces_;
};

REGISTER_OP("DsgdAliasTensor")
    .Input("handle: int64")
    .Output("partition: T")
    .Attr(kTypes)
    .Attr("size: int >= 0")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t size;
      TF_RETURN_IF_ERROR(c->GetAttr("size", &size));
      c->set_output(0, c->Vector(size));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Returns the buffer registered under `handle` as a 1-D tensor of
`size` elements that aliases it (no copy). The handle is released when the
last tensor using the memory is destroyed. A buffer that is not 64-byte
aligned is copied instead and released at once.
)doc");

class AliasTensorOp : public OpKernel {
 public:
  explicit AliasTensorOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("size", &size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &dtype_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& handle_tensor = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(handle_tensor.shape()),
                errors::InvalidArgument("handle must be a scalar, got shape ",
                                        handle_tensor.shape().DebugString()));
    const int64_t handle = handle_tensor.scalar<int64_t>()();
    dsgd::RegisteredBuffer buffer;
    OP_REQUIRES(ctx, dsgd::ClaimBuffer(handle, &buffer),
                errors::NotFound("no object-store buffer or shared-memory buffer "
                                 "is registered under handle ", handle));
    const size_t nbytes = size_ * DataTypeSize(dtype_);
    if (buffer.nbytes != nbytes) {
      dsgd::ReleaseBuffer(handle);
      ctx->CtxFailure(errors::InvalidArgument(
          "buffer ", handle, " has ", buffer.nbytes, " bytes, expected ", nbytes,
          " (", size_, " elements of ", DataTypeString(dtype_), ")"));
      return;
    }
    if (!IsAligned(buffer.data)) {
      Tensor* out = nullptr;
      absl::Status s = ctx->allocate_output(0, TensorShape({size_}), &out);
      if (s.ok()) std::memcpy(MutableData(out), buffer.data, nbytes);
      dsgd::ReleaseBuffer(handle);
      OP_REQUIRES_OK(ctx, s);
      return;
    }
    core::RefCountPtr<TensorBuffer> alias(new AliasedBuffer(handle, buffer.data, nbytes));
    ctx->set_output(0, Tensor(dtype_, TensorShape({size_}), std::move(alias)));
  }

 private:
  int64_t size_;
  DataType dtype_;
};

REGISTER_OP("DsgdUnpack")
    .Input("partitions: N * W")
    .Output("grads: num_outputs * T")
    .Attr(kTypes)
    .Attr(kWireTypes)
    .Attr("N: int >= 1")
    .Attr("num_outputs: int >= 1")
    .Attr("shapes: list(shape)")
    .Attr("piece_output: list(int)")
    .Attr("piece_input: list(int)")
    .Attr("piece_var_offset: list(int)")
    .Attr("piece_partition_offset: list(int)")
    .Attr("piece_size: list(int)")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      std::vector<PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("shapes", &shapes));
      for (size_t i = 0; i < shapes.size(); ++i) {
        shape_inference::ShapeHandle s;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &s));
        c->set_output(i, s);
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
Rebuilds gradients of the given `shapes` from flat partitions (inverse of
DsgdPack). An output held by one 64-byte-aligned piece of a partition of its
own dtype aliases its partition; any other output is copied together, and
bfloat16 or half partitions (`W`) are widened to a float32 `T` on the way.
)doc");

class UnpackOp : public OpKernel {
 public:
  explicit UnpackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int num_inputs, num_outputs;
    std::vector<PartialTensorShape> partial;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &num_inputs));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_outputs", &num_outputs));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shapes", &partial));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &grad_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("W", &wire_dtype_));
    OP_REQUIRES_OK(ctx, CheckConvertible(wire_dtype_, grad_dtype_));
    OP_REQUIRES(ctx, partial.size() == static_cast<size_t>(num_outputs),
                errors::InvalidArgument("shapes has ", partial.size(),
                                        " entries, expected num_outputs=", num_outputs));
    std::vector<Piece> pieces;
    OP_REQUIRES_OK(ctx, ReadPieces(ctx, true, &pieces));
    pieces_.resize(num_outputs);
    for (const PartialTensorShape& p : partial) {
      TensorShape shape;
      OP_REQUIRES(ctx, p.AsTensorShape(&shape),
                  errors::InvalidArgument("shape ", p.DebugString(), " is not fully defined"));
      shapes_.push_back(shape);
    }
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Piece& p = pieces[i];
      OP_REQUIRES(ctx, p.input >= 0 && p.input < num_inputs && p.output >= 0 &&
                           p.output < num_outputs,
                  errors::InvalidArgument("piece ", i, " has input ", p.input,
                                          " / output ", p.output, " out of range"));
      OP_REQUIRES_OK(ctx, CheckRange("output", p.output, p.var_offset, p.size,
                                     shapes_[p.output].num_elements()));
      pieces_[p.output].push_back(p);
    }
    for (int k = 0; k < num_outputs; ++k) {
      int64_t covered = 0;
      for (const Piece& p : pieces_[k]) covered += p.size;
      OP_REQUIRES(ctx, covered == shapes_[k].num_elements(),
                  errors::InvalidArgument("pieces cover ", covered, " of the ",
                                          shapes_[k].num_elements(),
                                          " elements of output ", k));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList partitions;
    OP_REQUIRES_OK(ctx, ctx->input_list("partitions", &partitions));
    for (int k = 0; k < static_cast<int>(pieces_.size()); ++k) {
      for (const Piece& p : pieces_[k]) {
        OP_REQUIRES_OK(ctx, CheckRange("partition", p.input, p.partition_offset, p.size,
                                       partitions[p.input].NumElements()));
      }
      OP_REQUIRES_OK(ctx, Output(ctx, partitions, k));
    }
  }

 private:
  absl::Status Output(OpKernelContext* ctx, const OpInputList& partitions, int k) {
    const std::vector<Piece>& pieces = pieces_[k];
    const size_t item = DataTypeSize(wire_dtype_);
    const size_t grad_item = DataTypeSize(grad_dtype_);
    if (pieces.size() == 1 && wire_dtype_ == grad_dtype_) {
      const Tensor& partition = partitions[pieces[0].input];
      char* data = const_cast<char*>(Data(partition)) + pieces[0].partition_offset * item;
      if (IsAligned(data)) {
        core::RefCountPtr<TensorBuffer> alias(new AliasBuffer(partition, data, pieces[0].size * item));
        ctx->set_output(k, Tensor(grad_dtype_, shapes_[k], std::move(alias)));
        return absl::OkStatus();
      }
    }
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(k, shapes_[k], &out));
    char* dst = MutableData(out);
    for (const Piece& p : pieces) {
      const char* src = Data(partitions[p.input]);
      CopyElements(wire_dtype_, grad_dtype_, src + p.partition_offset * item,
                   dst + p.var_offset * grad_item, p.size);
    }
    return absl::OkStatus();
  }

  DataType grad_dtype_;
  DataType wire_dtype_;
  std::vector<TensorShape> shapes_;
  std::vector<std::vector<Piece>> pieces_;  // per output
};

REGISTER_OP("DsgdDataAddress")
    .Input("x: T")
    .Output("address: int64")
    .Attr("T: type")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Returns the address of `x`'s data (for tests and debugging).");

class DataAddressOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() =
        reinterpret_cast<int64_t>(Data(ctx->input(0)));
  }
};

#define DSGD_REGISTER(type)                                                   \
  REGISTER_KERNEL_BUILDER(                                                    \
      Name("DsgdPack").Device(DEVICE_CPU).TypeConstraint<type>("T"), PackOp); \
  REGISTER_KERNEL_BUILDER(Name("DsgdAliasTensor")                            \
                              .Device(DEVICE_CPU)                             \
                              .TypeConstraint<type>("T"),                     \
                          AliasTensorOp);                                    \
  REGISTER_KERNEL_BUILDER(                                                    \
      Name("DsgdUnpack").Device(DEVICE_CPU).TypeConstraint<type>("T"), UnpackOp);

DSGD_REGISTER(Eigen::half);
DSGD_REGISTER(bfloat16);
DSGD_REGISTER(float);
DSGD_REGISTER(double);
DSGD_REGISTER(int8);
DSGD_REGISTER(uint8);
DSGD_REGISTER(int16);
DSGD_REGISTER(int32);
DSGD_REGISTER(int64_t);
#undef DSGD_REGISTER

REGISTER_KERNEL_BUILDER(Name("DsgdDataAddress").Device(DEVICE_CPU), DataAddressOp);

}  // namespace
}  // namespace tensorflow
