// The readers of files a user names: a FIFO, a device or a directory is refused at once (a FIFO
// used to block forever in open(), /dev/zero to be read until memory ran out).
#include "keel/core/mapped_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace keel {
namespace {

class FileReaders : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("keel-files-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string File(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

TEST_F(FileReaders, AFifoIsRefusedWithoutWaitingForAWriter) {
  const std::string fifo = File("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto mapped = MappedFile::Open(fifo);
  ASSERT_FALSE(mapped.ok());
  EXPECT_NE(mapped.status().message().find("not a regular file"), std::string::npos) << mapped.status().message();
  auto read = ReadFileToString(fifo);
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().message().find("not a regular file"), std::string::npos) << read.status().message();
}

TEST_F(FileReaders, DevicesAndDirectoriesAreRefusedByName) {
  auto zero = ReadFileToString("/dev/zero");
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().message(), "/dev/zero: not a regular file");
  auto dir = ReadFileToString(dir_.string());
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find("is a directory"), std::string::npos) << dir.status().message();
  auto mapped = MappedFile::Open(dir_.string());
  ASSERT_FALSE(mapped.ok());
  EXPECT_NE(mapped.status().message().find("is a directory"), std::string::npos) << mapped.status().message();
  EXPECT_EQ(ReadFileToString(File("missing")).status().code(), StatusCode::kNotFound);
}

TEST_F(FileReaders, ReadsWholeFilesUpToTheLimitAndNoFurther) {
  const std::string text(100000, 'x');
  std::ofstream(File("f")) << text;
  auto whole = ReadFileToString(File("f"));
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(*whole, text);
  auto exact = ReadSmallFile(File("f"), text.size());
  ASSERT_TRUE(exact.ok()) << exact.status().ToString();
  EXPECT_EQ(exact->size(), text.size());
  auto over = ReadFileToString(File("f"), text.size() - 1);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kInvalidArgument);
  std::ofstream(File("empty")).flush();
  auto empty = ReadFileToString(File("empty"));
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

}  // namespace
}  // namespace keel
