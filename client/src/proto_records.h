// A reply of the daemon's control service as the client's record (DaemonInfo, StatsReport and the
// records in it, client/include/trainstream/client.h): each field the record's VisitFields lists is read
// from the proto field of the same name, so the two are matched in one place.
//
// Invariant: a name the proto lacks, or a field whose type is not the member's (a uint32 member for a
// uint64 field, a list for a scalar), is kInternal naming both, never a protobuf CHECK failure:
// tests/cpp/client/proto_records_test.cpp keeps every record and its message in step.
#pragma once

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "shm/error.h"

namespace trainstream::proto_records {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

inline void Expect(const FieldDescriptor& field, FieldDescriptor::CppType type, bool repeated) {
  TS_CHECK(field.cpp_type() == type && field.is_repeated() == repeated, Code::kInternal,
           "the client reads field '{}' of {} as {}{}, but it is {}{}", field.name(), field.containing_type()->name(),
           repeated ? "a list of " : "", FieldDescriptor::CppTypeName(type), field.is_repeated() ? "a list of " : "",
           field.cpp_type_name());
}

inline void Read(const Message& m, const FieldDescriptor& f, uint32_t& out) {
  Expect(f, FieldDescriptor::CPPTYPE_UINT32, false);
  out = m.GetReflection()->GetUInt32(m, &f);
}
inline void Read(const Message& m, const FieldDescriptor& f, uint64_t& out) {
  Expect(f, FieldDescriptor::CPPTYPE_UINT64, false);
  out = m.GetReflection()->GetUInt64(m, &f);
}
inline void Read(const Message& m, const FieldDescriptor& f, int64_t& out) {
  Expect(f, FieldDescriptor::CPPTYPE_INT64, false);
  out = m.GetReflection()->GetInt64(m, &f);
}
inline void Read(const Message& m, const FieldDescriptor& f, double& out) {
  Expect(f, FieldDescriptor::CPPTYPE_DOUBLE, false);
  out = m.GetReflection()->GetDouble(m, &f);
}
inline void Read(const Message& m, const FieldDescriptor& f, bool& out) {
  Expect(f, FieldDescriptor::CPPTYPE_BOOL, false);
  out = m.GetReflection()->GetBool(m, &f);
}
inline void Read(const Message& m, const FieldDescriptor& f, std::string& out) {
  Expect(f, FieldDescriptor::CPPTYPE_STRING, false);
  out = m.GetReflection()->GetString(m, &f);
}
inline void Read(const Message& m, const FieldDescriptor& f, std::vector<uint32_t>& out) {
  Expect(f, FieldDescriptor::CPPTYPE_UINT32, true);
  const int n = m.GetReflection()->FieldSize(m, &f);
  for (int i = 0; i < n; ++i) out.push_back(m.GetReflection()->GetRepeatedUInt32(m, &f, i));
}
// A proto map is a list of entries whose fields are "key" and "value".
inline void Read(const Message& m, const FieldDescriptor& f, std::map<uint32_t, std::string>& out) {
  TS_CHECK(f.is_map(), Code::kInternal, "the client reads field '{}' of {} as a map, but it is not one", f.name(),
           f.containing_type()->name());
  const int n = m.GetReflection()->FieldSize(m, &f);
  for (int i = 0; i < n; ++i) {
    const Message& entry = m.GetReflection()->GetRepeatedMessage(m, &f, i);
    uint32_t key = 0;
    std::string value;
    Read(entry, *f.message_type()->map_key(), key);
    Read(entry, *f.message_type()->map_value(), value);
    out.emplace(key, std::move(value));
  }
}

template <typename Record>
Record FromProto(const Message& m);

template <typename Record>
void Read(const Message& m, const FieldDescriptor& f, std::vector<Record>& out) requires std::is_class_v<Record> {
  Expect(f, FieldDescriptor::CPPTYPE_MESSAGE, true);
  const int n = m.GetReflection()->FieldSize(m, &f);
  for (int i = 0; i < n; ++i) out.push_back(FromProto<Record>(m.GetReflection()->GetRepeatedMessage(m, &f, i)));
}

template <typename Record>
Record FromProto(const Message& m) {
  Record record;
  Record::VisitFields(record, [&m](const char* name, auto& member) {
    const FieldDescriptor* field = m.GetDescriptor()->FindFieldByName(name);
    TS_CHECK(field != nullptr, Code::kInternal, "the client reads field '{}', which {} does not have", name,
             m.GetDescriptor()->name());
    Read(m, *field, member);
  });
  return record;
}

}  // namespace trainstream::proto_records
